"""The package's shape: ARCHITECTURE.md's module table is the import order, between folders and inside each; no
circle; small folders, modules, classes and functions."""

import ast
import re

from helpers import ROOT

PACKAGE = ROOT / "lora_llama"
MAX_LINES = 350
MAX_CLASS_LINES = 150
MAX_FUNCTION_LINES = 60
MAX_FOLDER_MODULES = 12
MAX_TOP_LEVEL_MODULES = 9


def layout_table(text: str | None = None) -> list[str]:
    """Module paths (`kernels/gemm`, `errors`) in the order ARCHITECTURE.md's module table lists them."""
    text = text if text is not None else (ROOT / "ARCHITECTURE.md").read_text()
    return re.findall(r"^\| `lora_llama/([\w/]+)\.py` \|", text, flags=re.M)


def modules() -> list[str]:
    """Every module of the package as a path without `.py`, its `__init__` and `__main__` aside."""
    return sorted(
        p.relative_to(PACKAGE).with_suffix("").as_posix() for p in PACKAGE.rglob("*.py") if not p.stem.startswith("__")
    )


def folder_of(module: str) -> str:
    """A module's folder; a module directly in lora_llama/ is a unit of its own."""
    return module.split("/")[0]


def _resolve(dotted: str, names: list[str], known: set[str]) -> set[str]:
    """Package modules that `from lora_llama.<dotted> import <names>` reaches."""
    path = dotted.replace(".", "/")
    if path in known:
        return {path}
    return {f"{path}/{n}" if path else n for n in names if (f"{path}/{n}" if path else n) in known}


def package_imports(path, known: set[str] | None = None) -> set[str]:
    """Every package module a file imports, at the top or inside a function, absolute or relative."""
    known = set(modules()) if known is None else known
    here = path.relative_to(PACKAGE).parent.as_posix().replace("/", ".") if path.is_relative_to(PACKAGE) else ""
    here = "" if here == "." else here
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names = [a.name for a in node.names]
            if node.level:
                base = here.split(".")[: len(here.split(".")) - node.level + 1] if here else []
                dotted = ".".join([p for p in base if p] + ([node.module] if node.module else []))
                found |= _resolve(dotted, names, known)
            elif node.module == "lora_llama" or (node.module or "").startswith("lora_llama."):
                found |= _resolve(node.module.removeprefix("lora_llama").lstrip("."), names, known)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("lora_llama."):
                    found |= _resolve(a.name.removeprefix("lora_llama."), [], known)
    return found


def test_architecture_table_lists_every_module_once():
    table = layout_table()
    assert sorted(table) == modules(), "ARCHITECTURE.md's module table and lora_llama/ differ"


def test_the_table_keeps_each_folder_together():
    folders = [folder_of(m) for m in layout_table()]
    runs = [f for i, f in enumerate(folders) if i == 0 or folders[i - 1] != f]
    assert len(runs) == len(set(runs)), f"a folder's modules are split in the table: {runs}"


def _order_violations(level) -> list[tuple[str, str]]:
    table = layout_table()
    ranks = {}
    for m in table:
        ranks.setdefault(level(m), len(ranks))
    wrong = []
    for m in table:
        for dep in package_imports(PACKAGE / f"{m}.py"):
            same_folder = folder_of(dep) == folder_of(m)
            if level is folder_of and not same_folder and ranks[folder_of(dep)] > ranks[folder_of(m)]:
                wrong.append((m, dep))
            if level is not folder_of and same_folder and table.index(dep) >= table.index(m):
                wrong.append((m, dep))
    return wrong


def test_folders_import_only_folders_listed_above_them():
    """Between folders, imports run one way down the table: no circle between folders."""
    wrong = _order_violations(folder_of)
    assert not wrong, f"imports against the folder order (module, imported): {wrong}"


def test_modules_import_only_modules_listed_above_them_in_their_folder():
    wrong = _order_violations(lambda m: m)
    assert not wrong, f"imports against the module order inside a folder (module, imported): {wrong}"


def test_the_check_sees_absolute_relative_and_late_imports(tmp_path):
    (tmp_path / "pkg").mkdir()
    f = tmp_path / "m.py"
    f.write_text(
        "import os\nfrom lora_llama.a.x import y\ndef g():\n    from lora_llama.b import z, w\n"
        "    import lora_llama.c\n    from lora_llama import d\n"
    )
    known = {"a/x", "b/z", "c", "d", "e"}
    assert package_imports(f, known) == {"a/x", "b/z", "c", "d"}


def test_the_order_check_reads_the_table():
    text = "| `lora_llama/errors.py` | x |\n| `lora_llama/kernels/gemm.py` | y |\n"
    assert layout_table(text) == ["errors", "kernels/gemm"]


def test_model_knows_nothing_of_lora():
    for path in (PACKAGE / "model").glob("*.py"):
        assert not any(m.startswith("lora/") for m in package_imports(path)), path
        assert "LoRALinear" not in path.read_text(), path


def test_training_pushes_nothing_to_the_hub():
    for path in (PACKAGE / "training").glob("*.py"):
        assert not any(folder_of(m) == "outputs" for m in package_imports(path)), path


def test_folders_stay_small():
    counts = {  # a folder's own modules; a subpackage (objectives/grpo/) is a folder of its own
        f.relative_to(PACKAGE).as_posix(): len([p for p in f.glob("*.py") if p.stem != "__init__"])
        for f in PACKAGE.rglob("*")
        if f.is_dir() and (f / "__init__.py").exists()
    }
    assert max(counts.values()) <= MAX_FOLDER_MODULES, counts
    assert len(list(PACKAGE.glob("*.py"))) <= MAX_TOP_LEVEL_MODULES


def python_files():
    return [p for folder in ("lora_llama", "tests", "bench") for p in (ROOT / folder).rglob("*.py")] + [ROOT / "cli.py"]


def test_every_file_is_small():
    sizes = {p.relative_to(ROOT).as_posix(): len(p.read_text().splitlines()) for p in python_files()}
    assert max(sizes.values()) <= MAX_LINES, {k: v for k, v in sizes.items() if v > MAX_LINES}


def long_definitions(path) -> list[str]:
    """Functions over MAX_FUNCTION_LINES and classes over MAX_CLASS_LINES, with their lengths."""
    found = []
    for n in ast.walk(ast.parse(path.read_text())):
        limit = {
            ast.FunctionDef: MAX_FUNCTION_LINES,
            ast.AsyncFunctionDef: MAX_FUNCTION_LINES,
            ast.ClassDef: MAX_CLASS_LINES,
        }.get(type(n))
        if limit and n.end_lineno - n.lineno + 1 > limit:
            found.append(f"{path.name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)")
    return found


def test_no_function_or_class_is_long():
    found = [f for p in python_files() for f in long_definitions(p)]
    assert not found, found


def test_the_length_check_counts_lines(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 60 + "class Big:\n" + "    x = 1\n" * 150
    )
    assert long_definitions(f) == ["m.py:long (61 lines)", "m.py:Big (151 lines)"]


MODULE_ATTRIBUTES = {"Module", "Linear", "weight", "bias", "lm_head", "low_rank_node", "transient_weight", "unshard"}


def module_reads(path) -> list[str]:
    """'line: name' where a file reads what only modules have (a layer's weight, a model's lm_head, nn.Module) or
    calls something named model."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in MODULE_ATTRIBUTES:
            found.append(f"{node.lineno}: .{node.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "model":
            found.append(f"{node.lineno}: model(...)")
    return found


def test_kernels_know_tensors_not_models():
    found = {p.name: module_reads(p) for p in (PACKAGE / "kernels").glob("*.py")}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_the_kernel_check_sees_a_model(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def loss(model, h):\n    return model(h) @ model.lm_head.weight.T\n")
    assert sorted(module_reads(f)) == ["2: .lm_head", "2: .weight", "2: model(...)"]


def test_no_formatting_is_switched_off():
    """The size limits are met by the code as ruff formats it, not by lines kept from the formatter."""
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in python_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if re.search(r"#\s*fmt:\s*(skip|off)", line)
    ]
    assert not found, found


def test_every_public_name_imports_from_the_package():
    import lora_llama

    missing = [name for name in lora_llama.__all__ if getattr(lora_llama, name, None) is None]
    assert not missing, missing
