"""Issue 40's norm_cast (CPU only): in which HF modules does a layer hand a norm's output only
to one submodule that passes it only to its projections? Those are the layers the norm_cast
rewrite wraps (the norm then writes the dtype autocast's Linears cast it to, bf16).

Read with the rewrite's own analyses, over every `transformers.models.*.modeling_*` module:
`compositions.scan_norm_handoffs` (a layer's forward hands a norm's output to one submodule) and
`compositions.scan_consumers` (a class's forward passes its input only to its attributes'
calls), the submodule's class found from the call in `__init__` that made the attribute. Which
of those attributes are Linear (or GPT-2's Conv1D) is a run-time question; the report names them.

  python3 scripts/dev/norm_consumers.py [--out DIR]   (writes DIR/norm_consumers.md)
"""
import argparse
import ast
import importlib
import inspect
import pkgutil
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from torchfuse import compositions  # noqa: E402


def init_classes(cls):
    """{attribute: class name} of `self.<attr> = SomeClass(...)` in cls.__init__."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__init__)))
    except (OSError, TypeError, SyntaxError):
        return {}
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
            for target in node.targets:
                if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id == "self" and name):
                    out[target.attr] = name
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    import transformers.models as models

    rows, layers, served_layers, families = [], 0, 0, set()
    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda i: i.name):
        try:
            module = importlib.import_module(f"transformers.models.{info.name}.modeling_{info.name}")
        except Exception:  # noqa: BLE001 - families that do not import are coverage.py's report
            continue
        classes = {c.__name__: c for c in vars(module).values()
                   if isinstance(c, type) and c.__module__ == module.__name__}
        consumers = compositions.scan_consumers(module)
        for cls, pairs in compositions.scan_norm_handoffs(module).items():
            layers += 1
            made, found = init_classes(cls), []
            for norm, sub, _how in pairs:
                consumer = consumers.get(classes.get(made.get(sub, "")))
                found.append((norm, sub, made.get(sub, "?"), consumer[1] if consumer else None))
            if any(sites for *_, sites in found):
                served_layers += 1
                families.add(info.name)
            rows.append((info.name, cls.__name__, found))
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    causal = {t.replace("-", "_") for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES}
    lines = ["# Norm outputs that reach only projections (issue 40's next cast)", "",
             f"transformers {importlib.import_module('transformers').__version__}: {layers} classes hand a "
             f"norm's output to one submodule; in {served_layers} of them ({len(families)} families) that "
             "submodule's forward passes it only to its attributes' calls (the projections: where they are "
             "plain Linear layers under autocast, the norm could write bf16). Of the causal-LM model types "
             f"(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, {len(causal)}), {len(causal & families)} have such a class "
             "in their modeling module.", "",
             "| family | class | norm → submodule (its class): the input's sites, or – |", "|---|---|---|"]
    for family, name, found in rows:
        cells = "; ".join(f"{norm} → {sub} ({sub_cls}): {', '.join(sites) if sites else '–'}"
                          for norm, sub, sub_cls, sites in found)
        lines.append(f"| {family} | {name} | {cells} |")
    text = "\n".join(lines) + "\n"
    print("\n".join(lines[:3]))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "norm_consumers.md").write_text(text)


if __name__ == "__main__":
    main()
