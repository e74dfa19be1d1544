"""Which code forms of the installed transformers torchfuse recognises (issue 39's coverage
harness, its CPU part): every `transformers.models.*.modeling_*` module is imported and scanned
as the rewrite layer scans it; the report lists per module the classes and functions
recognised (and the op their form computes) and those near a known form (a familiar name or
call shape, other code: what to add next), and counts the near ones by form.

A recognised form is served at run time only where its guards hold (a gated MLP whose act_fn
is not SiLU, Gemma's GELU MLP, runs the original code).

  python3 scripts/bench/coverage.py [--out DIR]   (writes DIR/coverage.md; no GPU needed)

Its training part (`--train`, the GPU): every causal-LM class of the installed transformers, a
tiny config of each (coverage_worker.py), trained a few steps stock and under torchfuse in
worker processes (a chunk of models each: one that kills its process costs only its chunk);
the report gives per model the ops torchfuse served, the largest loss difference and any error.

  python3 scripts/bench/coverage.py --train --lib-dir DIR --out DIR [--models a,b] [--device cuda]
"""
import argparse
import collections
import importlib
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))

from torchfuse import compositions  # noqa: E402


def modeling_modules():
    """(model family, its modeling module or the import error's text), every family in order,
    after the shared modules the rewrite layer also scans (activations, the loss functions, the
    MoE experts' gate, the attention masks, the KV cache's layers)."""
    import transformers.models as models

    for shared in ("activations", "loss.loss_utils", "integrations.moe", "masking_utils", "cache_utils"):
        yield shared, importlib.import_module(f"transformers.{shared}")

    for info in sorted(pkgutil.iter_modules(models.__path__), key=lambda i: i.name):
        name = f"transformers.models.{info.name}.modeling_{info.name}"
        try:
            yield info.name, importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:  # the family has such a module, which needs a package not here
                yield info.name, f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - a family that cannot import is reported, not fatal
            yield info.name, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def scan(module):
    """({name: form} recognised, {name: form} near) of one modeling module."""
    recognised = {cls.__name__: form for cls, form in compositions.scan(module).items()}
    recognised.update(compositions.scan_functions(module))
    recognised.update({f"{cls.__name__}.{method}": form
                       for cls, (method, form) in compositions.scan_methods(module).items()})
    return recognised, compositions.near_forms(module)


def code_of(module, name):
    """The code a near class's forward or a near function runs."""
    value = getattr(module, name)
    return getattr(value.__dict__.get("forward") if isinstance(value, type) else value, "__code__", None)


def code_key(code):
    """Codes that are the same composition (bytecode, the names it loads, its constants other
    than nested code and docstrings) share a key, whatever the class is called."""
    consts = tuple(c for c in code.co_consts if not hasattr(c, "co_code") and not isinstance(c, str))
    return code.co_code, code.co_names, repr(consts)


def report():
    import transformers

    rows, near_count, recognised_count, failed = [], collections.Counter(), collections.Counter(), []
    near_codes = collections.defaultdict(list)  # (form, code key) -> [family.name]
    for family, module in modeling_modules():
        if isinstance(module, str):
            failed.append(f"- `{family}`: {module}")
            continue
        recognised, near = scan(module)
        recognised_count.update(recognised.values())
        near_count.update(near.values())
        for name, form in near.items():
            code = code_of(module, name)
            if code is not None:
                near_codes[(form, code_key(code))].append(f"{family}.{name}")
        if recognised or near:
            show = lambda d: ", ".join(f"`{n}` ({f})" for n, f in sorted(d.items())) or "–"  # noqa: E731
            rows.append(f"| {family} | {show(recognised)} | {show(near)} |")
    lines = [f"# Code forms torchfuse recognises in transformers {transformers.__version__}", "",
             "`python3 scripts/bench/coverage.py --out DIR`. Recognised: the rewrite layer replaces it "
             "(where its guards hold at run time); near: a familiar name or call shape with other code, "
             "left as it is.", "",
             "| form | op | modules recognised | modules near |", "|---|---|---|---|"]
    for form in sorted(set(recognised_count) | set(near_count)):
        lines.append(f"| {form} | {compositions.COMPUTES.get(form, '–')} | {recognised_count[form]} | "
                     f"{near_count[form]} |")
    lines += ["", "Near forms grouped by code (the same composition under many names), most copies first: "
              "the forms to add next.", "", "| form it is near | copies | e.g. |", "|---|---|---|"]
    groups = sorted(near_codes.items(), key=lambda item: -len(item[1]))
    for (form, _), names in groups[:20]:
        lines.append(f"| {form} | {len(names)} | {', '.join(f'`{n}`' for n in names[:3])} |")
    lines += ["", "| model family | recognised | near a known form |", "|---|---|---|", *rows]
    if failed:
        lines += ["", "Modeling modules that did not import here:", "", *failed]
    return "\n".join(lines) + "\n"


WORKER = Path(__file__).resolve().parent / "coverage_worker.py"


def run_chunk(side, device, models, lib_dir):
    """{model: result} of one worker. Where it stops early (killed: out of memory), the first
    model it did not report gets the worker's exit and last words as its error, and the rest run
    in a fresh worker."""
    import json
    import subprocess

    args = [sys.executable, str(WORKER), side, device, ",".join(models)] + ([lib_dir] if side == "torchfuse" else [])
    proc = subprocess.run(args, capture_output=True, text=True, timeout=3600)
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            results[result["model"]] = result
    missing = [model for model in models if model not in results]
    if missing:
        last = (proc.stderr.strip().splitlines() or [""])[-1][:200]
        results[missing[0]] = {"model": missing[0], "side": side,
                               "error": f"worker exit {proc.returncode} in it: {last}"}
        if missing[1:]:
            results.update(run_chunk(side, device, missing[1:], lib_dir))
    return results


def train_report(args):
    import json

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    models = args.models.split(",") if args.models else list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    sides = ["stock", "torchfuse"] if args.device == "cuda" else ["stock"]
    runs = {side: {} for side in sides}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_jsonl:  # the table again from a run's results (one cut short: what it reached)
        for line in Path(args.from_jsonl).read_text().splitlines():
            result = json.loads(line)
            runs.setdefault(result["side"], {})[result["model"]] = result
        models = [m for m in models if m in runs["stock"]]
    for start in range(0, len(models), args.chunk):
        if args.from_jsonl:
            break
        chunk = models[start:start + args.chunk]
        for side in sides:
            runs[side].update(run_chunk(side, args.device, chunk, args.lib_dir))
            print(f"{side}: {min(start + args.chunk, len(models))}/{len(models)}", file=sys.stderr, flush=True)
        with open(out / "coverage-train.jsonl", "w") as f:  # after each chunk: a cut run keeps its part
            for side in sides:
                for result in runs[side].values():
                    f.write(json.dumps(result) + "\n")
    lines = [f"# Tiny causal LMs of the installed transformers trained stock and under torchfuse ({args.device})", "",
             f"`python3 scripts/bench/coverage.py --train --device {args.device} ...`: each model "
             "at tiny sizes (or, where its own dims do not follow from them, its default widths at two layers), "
             "3 steps of bf16 autocast, AdamW; first-step diff: |torchfuse - stock| / |stock| of the loss before any "
             "update (the ops alone); loss diff: the largest relative difference over the steps (the updates "
             "amplify it where a model's training diverges at these sizes).", "",
             "| model | sizes | torchfuse served | first-step diff | loss diff | error |", "|---|---|---|---|---|---|"]
    trained = failed_ours = 0
    for model in models:
        stock, ours = runs["stock"][model], runs.get("torchfuse", {}).get(model, {})
        served = ", ".join(sorted(ours.get("fused", {}))) or "–"
        first = diff = "–"
        if "losses" in stock and "losses" in ours:
            relative = [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(ours["losses"], stock["losses"])]
            first, diff = f"{relative[0]:.1e}", f"{max(relative):.1e}"
        error = stock.get("error", "")
        if ours.get("error") and not error:
            error, failed_ours = "torchfuse only: " + ours["error"], failed_ours + 1
        trained += "losses" in stock
        lines.append(f"| {model} | {stock.get('sizes', '–')} | {served} | {first} | {diff} | {error[:240]} |")
    lines[4:4] = [f"{trained} of {len(models)} train stock; {failed_ours} fail under torchfuse only.", ""]
    text = "\n".join(lines) + "\n"
    (out / "coverage-train.md").write_text(text)
    print(text)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--train", action="store_true", help="the GPU part: train every causal LM")
    parser.add_argument("--lib-dir", default=str(ROOT / ".dev"))
    parser.add_argument("--models", help="model types, comma-separated (default: every causal LM)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--chunk", type=int, default=20)
    parser.add_argument("--from-jsonl", help="with --train: the table from this coverage-train.jsonl, nothing run")
    args = parser.parse_args()
    if args.train:
        if not args.out:
            parser.error("--train needs --out")
        train_report(args)
        return
    text = report()
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "coverage.md").write_text(text)


if __name__ == "__main__":
    main()
