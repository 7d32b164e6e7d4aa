"""The package's shape: ARCHITECTURE.md's module table is the import order, no circle, small modules and functions."""
import ast
import re

from helpers import ROOT

PACKAGE = ROOT / "lora_llama"
MAX_LINES = 350
MAX_FUNCTION_LINES = 60


def layout_table() -> list[str]:
    """Module names in the order ARCHITECTURE.md's module table lists them."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    return re.findall(r"^\| `lora_llama/(\w+)\.py` \|", text, flags=re.M)


def package_imports(path) -> set[str]:
    """Every package module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1 and node.module:  # from .x import ...
                found.add(node.module.split(".")[0])
            elif node.level == 1:  # from . import x
                found.update(a.name for a in node.names)
            elif node.module and node.module.startswith("lora_llama."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("lora_llama."))
    return found


def modules() -> list[str]:
    return sorted(p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("__"))


def test_architecture_table_lists_every_module_once():
    table = layout_table()
    assert sorted(table) == modules(), "ARCHITECTURE.md's module table and lora_llama/ differ"


def test_imports_run_one_way_down_the_table():
    """A module imports only modules listed above it in ARCHITECTURE.md's table: no circle, not even inside a function."""
    order = {name: i for i, name in enumerate(layout_table())}
    wrong = [(m, dep) for m in modules() for dep in package_imports(PACKAGE / f"{m}.py")
             if dep in order and order[dep] >= order[m]]
    assert not wrong, f"imports against the layout order (module, imported): {wrong}"


def test_the_check_sees_imports_inside_functions(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom .a import x\ndef g():\n    from . import b\n    import lora_llama.c\n    from .d.e import y\n")
    assert package_imports(f) == {"a", "b", "c", "d"}


def test_model_knows_nothing_of_lora():
    assert "lora" not in package_imports(PACKAGE / "model.py")
    assert "LoRALinear" not in (PACKAGE / "model.py").read_text()


def test_every_module_is_small():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert max(sizes.values()) <= MAX_LINES, {k: v for k, v in sizes.items() if v > MAX_LINES}


def python_files():
    return [p for folder in ("lora_llama", "tests", "bench") for p in (ROOT / folder).glob("*.py")] + [ROOT / "cli.py"]


def long_functions(path) -> list[str]:
    return [f"{path.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_long():
    found = [f for p in python_files() for f in long_functions(p)]
    assert not found, found


def test_the_function_check_counts_lines(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 60)
    assert long_functions(f) == ["m.py:long (61 lines)"]
