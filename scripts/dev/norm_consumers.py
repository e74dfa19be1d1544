"""Issue 40's next cast (design input, CPU only): in which HF decoder layers does a norm's output
go only to one submodule that passes it only to its projections? There the norm could write
the dtype autocast's Linears cast it to (bf16), instead of fp32 that each projection (or
shared_cast, once) casts again, and the backward's cast back would fold into the norm's.

Read from the source of every `transformers.models.*.modeling_*` module: a class's `forward`
with `h = self.<norm>(x)` (an attribute whose name says norm), then `h` used only as an
argument of one `self.<sub>(...)` call before it is assigned again or the function ends, and
`<sub>`'s class (the call in `__init__` that made the attribute) a class of the same module
whose forward, read as shared_cast reads it (`compositions.linear_input_sites`), passes its
input only to its attributes' calls, or first thing hands it to one (`x = self.fc1(x)`). Which of those attributes are Linear (or GPT-2's Conv1D) is
a run-time question; the report names them.

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


def self_call(node):
    """`self.<attr>(...)`: attr, else None."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"):
        return node.func.attr
    return None


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


def handoffs(forward, made):
    """(norm attr, sub attr) pairs of `h = self.<norm>(...)` whose value reaches only one
    `self.<sub>(...)` call (as an argument) before `h` is assigned again, and of
    `self.<sub>(self.<norm>(...), ...)` (GPT-NeoX's parallel residual). A norm: an attribute
    whose name or whose class's (`made`, from __init__) says so (GPT-2's `ln_1`: a LayerNorm)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return []
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []

    def is_norm(attr):
        return attr is not None and ("norm" in attr.lower() or "Norm" in made.get(attr, ""))

    out = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and self_call(n)):
        for arg in list(call.args) + [k.value for k in call.keywords]:
            if is_norm(self_call(arg)):
                out.append((self_call(arg), self_call(call)))
    for i, stmt in enumerate(body):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            continue
        norm = self_call(stmt.value)
        if not is_norm(norm):
            continue
        var, uses = stmt.targets[0].id, []
        for later in body[i + 1:]:
            loads = [n for n in ast.walk(later) if isinstance(n, ast.Name) and n.id == var
                     and isinstance(n.ctx, ast.Load)]
            for load in loads:
                parent = next((c for c in ast.walk(later) if isinstance(c, ast.Call)
                               and (load in c.args or any(k.value is load for k in c.keywords))), None)
                uses.append(self_call(parent) if parent is not None else None)
            stores = [n for n in ast.walk(later) if isinstance(n, ast.Name) and n.id == var
                      and isinstance(n.ctx, ast.Store)]
            if stores or isinstance(later, ast.Return):
                break
        if len(uses) == 1 and uses[0] is not None:
            out.append((norm, uses[0]))
    return list(dict.fromkeys(out))


def input_sites(forward):
    """Where a submodule's forward sends its input: shared_cast's reading
    (`compositions.linear_input_sites`), or, where the forward's first statement is
    `x = self.<a>(x)` (an MLP's first projection: x is then another tensor), (a,)."""
    sites = compositions.linear_input_sites(forward)
    if sites:
        return sites
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    function = tree.body[0] if tree.body and isinstance(tree.body[0], ast.FunctionDef) else None
    if function is None or len(function.args.args) < 2:
        return None
    x = function.args.args[1].arg
    body = [b for b in function.body if not (isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant))]
    first = body[0] if body else None
    if (isinstance(first, ast.Assign) and len(first.targets) == 1 and isinstance(first.targets[0], ast.Name)
            and first.targets[0].id == x and self_call(first.value) and not first.value.keywords
            and [getattr(a, "id", None) for a in first.value.args] == [x]):
        return (self_call(first.value),)
    return None


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
        for cls in classes.values():
            forward = cls.__dict__.get("forward")
            if forward is None:
                continue
            made = init_classes(cls)
            pairs = handoffs(forward, made)
            if not pairs:
                continue
            layers += 1
            found = []
            for norm, sub in pairs:
                sub_cls = classes.get(made.get(sub, ""))
                sub_forward = sub_cls.__dict__.get("forward") if sub_cls else None
                sites = input_sites(sub_forward) if sub_forward else None
                found.append((norm, sub, made.get(sub, "?"), sites))
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
