// `make lint`'s check of the studio's page script, lora_llama/studio/page.js: eslint's recommended rules for a
// browser script (the functions the page's onclick attributes call are listed in its `/* exported */` comment)
import js from "@eslint/js";
import globals from "globals";

export default [
  js.configs.recommended,
  {
    files: ["lora_llama/studio/page.js"],
    languageOptions: { ecmaVersion: 2022, sourceType: "script", globals: globals.browser },
  },
];
