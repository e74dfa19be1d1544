"""Whole training steps of real models nobody here wrote, trained unchanged: stock eager,
torchfuse eager (under scripts/torchfuse), stock torch.compile and torchfuse + torch.compile;
for the Llama model also Liger-Kernel's one-line patch (`liger`), where liger_kernel imports.

Each (model, side) runs in a fresh process (a worker of this script), rounds interleaved over
the sides. A worker builds its model from a config (no downloads), draws fixed random data,
trains with the default AdamW, and reports the median step time over CUDA events after
warm-up, the peak memory and every step's loss. The driver writes a markdown table, JSON and,
where matplotlib is installed, a PNG bar chart.

  python3 scripts/bench/bench_models.py --lib-dir .dev --out $OUT [--models gpt2,llama]
      [--sides stock,torchfuse,compile,torchfuse+compile,liger] [--rounds 2] [--steps 30]
  (--models also takes gpt2-b32, GPT-2 at batch 32, and the families of FAMILIES at realistic
  sizes: qwen2.5-0.5b, gemma-2b, pythia-410m, mistral-0.9b, phi3-2b, qwen3-0.6b, olmo2-1b,
  gemma3-1b, glm4-1.4b, cohere-1.3b, gptj-0.8b, mixtral-moe-0.9b)

Every run is also appended to OUT/bench_models.jsonl as it ends; `--merge A.jsonl B.jsonl`
reports the runs of several calls as one table.

A side `torchfuse:SPEC` runs torchfuse with TORCHFUSE_OPS=SPEC, `/` standing for `,` (e.g.
`torchfuse:-rotary/-swiglu`): which op a loss difference or a slowdown comes from. A side
`torchfuse+graphs[:SPEC]` adds TORCHFUSE_LAYER_GRAPHS=1 (each decoder layer as CUDA graphs).

With two or more rounds the report adds each side's speed-up round by round (rounds are
interleaved: a pair of runs shares the machine's state) beside the ratio of medians.

Loss differences are taken over every pair of a side's run and a stock run. With two or more
stock runs of a model (rounds, or `stock` named twice in --sides), stock's row gives stock's own
run-to-run difference: the noise the others are judged against. Runs of 100 losses or more add
a table per model of the differences per step (largest, mean, mean of the last quarter); 100
losses, warm-up included.
The side `stock-fused-adam` is stock with PyTorch's own `AdamW(fused=True)`: how far a
rounding change PyTorch itself offers moves the losses (torchfuse's Adam is a fused step).
"""
import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODELS = ["gpt2", "llama", "bert", "vit"]
SIDES = ["stock", "torchfuse", "compile", "torchfuse+compile", "liger"]
# Liger-Kernel patches HF Llama (RMSNorm, RoPE, SwiGLU, fused linear cross-entropy) in one line
# of user code; it has no patch for the other models.
LIGER_MODELS = {"llama"}


# Issue 39's families at realistic sizes, random weights (as large as fits with AdamW's fp32
# states on one H100): name -> (config class, model class, its dims, (batch, length), what).
FAMILIES = {
    "qwen2.5-0.5b": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                          num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                          tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=1024),
                     (4, 1024), "HF Qwen2.5-0.5B shape"),
    "gemma-2b": ("GemmaConfig", "GemmaForCausalLM",
                 dict(hidden_size=2048, intermediate_size=16384, num_hidden_layers=18,
                      num_attention_heads=8, num_key_value_heads=1, head_dim=256, vocab_size=256000,
                      max_position_embeddings=1024),
                 (2, 1024), "HF Gemma-2B shape"),
    "pythia-410m": ("GPTNeoXConfig", "GPTNeoXForCausalLM",
                    dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                         num_attention_heads=16, rotary_pct=0.25, vocab_size=50304,
                         max_position_embeddings=1024, hidden_dropout=0.0, attention_dropout=0.0),
                    (4, 1024), "HF Pythia-410M shape (GPT-NeoX, partial rotary)"),
    "mistral-0.9b": ("MistralConfig", "MistralForCausalLM",
                   dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                        num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                        sliding_window=4096, max_position_embeddings=1024),
                   (4, 1024), "HF Mistral-style 0.9B (16 layers, hidden 2048, GQA 16/8)"),
    "phi3-2b": ("Phi3Config", "Phi3ForCausalLM",
                dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                     max_position_embeddings=1024, pad_token_id=0),
                (2, 1024), "HF Phi-3-mini shape at 16 of its 32 layers (fused gate_up, qkv)"),
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM",
                   dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                        vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=1024),
                   (4, 1024), "HF Qwen3-0.6B shape (q/k RMSNorm)"),
    "olmo2-1b": ("Olmo2Config", "Olmo2ForCausalLM",
                 dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
                      rope_theta=500000.0, max_position_embeddings=1024),
                 (4, 1024), "HF OLMo-2-1B shape (post-norm, q/k RMSNorm over the projection, cast-back rotary)"),
    "gemma3-1b": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                  dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
                       sliding_window=512, max_position_embeddings=1024),
                  (4, 1024), "HF Gemma-3-1B shape (q/k Gemma norms, GeGLU, sliding window)"),
    # The interleaved rotaries: GLM-4's (a half of each head rotated, pair by pair), Cohere's (all
    # of it, in fp32; parallel attention and MLP after one LayerNorm).
    "glm4-1.4b": ("Glm4Config", "Glm4ForCausalLM",
                  dict(hidden_size=2048, intermediate_size=6848, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=2, head_dim=128, vocab_size=151552,
                       max_position_embeddings=1024),
                  (4, 1024), "HF GLM-4-9B shape at hidden 2048, 16 layers, 1.4B (GQA 16/2, partial interleaved rotary)"),
    "cohere-1.3b": ("CohereConfig", "CohereForCausalLM",
                  dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=16, vocab_size=256000,
                       max_position_embeddings=1024),
                  (4, 1024), "HF Command-R shape at hidden 2048, 16 layers, 1.3B (LayerNorm, interleaved rotary in fp32)"),
    # GPT-J's rotate_every_two (CodeGen's too): one tensor at a time, 64 of each 256-wide head
    # rotated pair by pair; GPT-J's own attention (no SDPA), parallel attention and MLP.
    "gptj-0.8b": ("GPTJConfig", "GPTJForCausalLM",
                  dict(n_embd=2048, n_layer=12, n_head=8, rotary_dim=64, n_positions=1024, vocab_size=50400),
                  (4, 1024), "HF GPT-J-6B shape at hidden 2048, 12 layers, 0.8B (rotate_every_two of 64 of 256)"),
    # MoE: the experts' gate (HF's _default_apply_gate under the default grouped_mm experts).
    "mixtral-moe-0.9b": ("MixtralConfig", "MixtralForCausalLM",
                         dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                              num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                              num_experts_per_tok=2, vocab_size=32000, max_position_embeddings=1024),
                         (4, 1024), "HF Mixtral-style MoE 0.9B (12 layers, 8 experts, top-2, grouped_mm)"),
}


def build(name, torch):
    """(model, batch maker, tokens or samples per step, description) for one model."""
    g = torch.Generator(device="cpu").manual_seed(0)
    if name in ("gpt2", "gpt2-b32"):
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50304,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        batch = 32 if name == "gpt2-b32" else 8  # B32: the throughput regime llm.c is run at
        model, (b, s), vocab = GPT2LMHeadModel(cfg), (batch, 1024), 50304
        what = f"HF GPT-2 124M, B{batch} S1024, bf16 autocast"
    elif name in ("llama", "llama-lora"):
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                          num_attention_heads=16, num_key_value_heads=8, vocab_size=32000,
                          max_position_embeddings=1024)
        model, (b, s), vocab = LlamaForCausalLM(cfg), (4, 1024), 32000
        what = "HF Llama-style (12 layers, hidden 1024, GQA 16/8, vocab 32000), B4 S1024, bf16 autocast"
        if name == "llama-lora":
            # A LoRA fine-tune as PEFT's docs make one: adapters of rank 16 on every Linear,
            # dropout 0.05, the base weights frozen (the optimizer steps the adapters only).
            import peft
            model = peft.get_peft_model(model, peft.LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear"))
            what = what.replace("HF Llama-style", "HF Llama-style + PEFT LoRA r16 on every Linear")
    elif name in FAMILIES:
        import transformers
        config_name, model_name, dims, (b, s), what = FAMILIES[name]
        cfg = getattr(transformers, config_name)(**dims)
        model, vocab = getattr(transformers, model_name)(cfg), cfg.vocab_size
        what = f"{what}, B{b} S{s}, bf16 autocast"
    elif name == "bert":
        from transformers import BertConfig, BertForMaskedLM
        cfg = BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        model, (b, s), vocab = BertForMaskedLM(cfg), (32, 128), cfg.vocab_size
        what = "HF BERT-base MLM, B32 S128, bf16 autocast"
    elif name == "vit":
        import timm
        model = timm.create_model("vit_small_patch16_224", pretrained=False, num_classes=1000)
        images = torch.randn(64, 3, 224, 224, generator=g)
        labels = torch.randint(0, 1000, (64,), generator=g)
        return model, lambda m: torch.nn.functional.cross_entropy(
            m(images.cuda(non_blocking=True)), labels.cuda()), 64, "timm ViT-S/16, B64, bf16 autocast"
    else:
        raise SystemExit(f"unknown model {name}")
    ids = torch.randint(0, vocab, (b, s), generator=g)
    return model, lambda m: m(input_ids=ids.cuda(), labels=ids.cuda()).loss, b * s, what


def train_step(torch, stepped, loss_of, opt, autocast=True):
    """One unchanged training step (forward under bf16 autocast, backward, the optimizer's
    step); its loss."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of(stepped)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def timed_steps(torch, stepped, loss_of, opt, warmup, steps, autocast=True):
    """The median step time in ms over CUDA events after `warmup` steps (peak memory is counted
    from there on), and every step's loss."""
    losses, times = [], []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        losses.append(train_step(torch, stepped, loss_of, opt, autocast))
        end.record()
        if i >= warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times), [float(x) for x in losses]


def adamw(torch, params, side):
    """The job's unchanged `AdamW(params, lr=1e-4)` (PyTorch's default step), or for the side
    `stock-fused-adam` PyTorch's own fused one."""
    return torch.optim.AdamW(params, lr=1e-4, fused=True if side == "stock-fused-adam" else None)


def loss_diff(a, b):
    """The largest |loss difference| over the steps of two runs (same data and init)."""
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def loss_pairs(runs, stock, own):
    """Every pair of a run and a stock run that both have losses; with `own` (the runs are
    stock's), every pair of two different stock runs, once. A side's pairs (n_side x n_stock)
    outnumber stock's own (n_stock choose 2), so a side's largest difference is drawn from more
    pairs: a comparison of maxima leans against the side."""
    runs = [r for r in runs if r.get("losses")]
    stock = [b for b in stock if b.get("losses")]
    return list(itertools.combinations(stock, 2)) if own else [(r, b) for r in runs for b in stock]


def max_loss_diff(runs, stock, own):
    """The largest |loss difference| over every pair of `loss_pairs`: for stock's own runs, its
    run-to-run noise; nan where there is no pair (one stock run)."""
    return max((loss_diff(r, b) for r, b in loss_pairs(runs, stock, own)), default=float("nan"))


def length_label(runs, name, group=None):
    """A labelling of runs: `name(r)`, with " (N losses)" added where the runs of its group
    (`group(r)`, default its name) differ in length, as merged calls' runs may: losses pair step
    for step only within one length."""
    group = group or name
    lengths = {}
    for r in runs:
        lengths.setdefault(group(r), set()).add(len(r.get("losses") or []))
    return lambda r: (name(r) if len(lengths[group(r)]) == 1
                      else f"{name(r)} ({len(r.get('losses') or [])} losses)")


def paired_lines(title, sides):
    """With two or more rounds: each side's speed-up round by round (the n-th stock run over the
    side's n-th run; rounds are interleaved, so a pair shares the machine's state), and their
    median, beside the table's ratio of medians. [] with one round."""
    stock = sides.get("stock") or []
    lines = []
    for side, runs in sides.items():
        if side == "stock" or len(runs) < 2 or len(runs) != len(stock):
            continue
        ratios = [b["ms"] / r["ms"] for r, b in zip(runs, stock)]
        lines.append(f"- {title}, {side} round by round: " + ", ".join(f"{x:.2f}x" for x in ratios)
                     + f" (median {statistics.median(ratios):.2f}x)")
    return ["\n" + "\n".join(lines)] if lines else []


def drift_lines(title, sides):
    """For long runs (100 losses or more): each side's |loss difference| per step from stock's
    runs, over every pair of `loss_pairs`, as largest, mean and mean over the last quarter of
    the steps (the range over the pairs where there are several). Rounding noise stays flat or
    shrinks as the loss settles; a drift grows. [] for shorter runs."""
    stock = sides.get("stock") or []
    if not stock or len(stock[0].get("losses") or []) < 100:
        return []
    lines = [f"\n{title}, |loss difference| per step over {len(stock[0]['losses'])} steps (warm-up included):\n",
             "| pair | pairs of runs | largest | mean | mean of the last quarter |", "|---|---|---|---|---|"]
    for side, runs in sides.items():
        per_pair = []
        for r, b in loss_pairs(runs, stock, side == "stock"):
            d = [abs(x - y) for x, y in zip(r["losses"], b["losses"])]
            per_pair.append((max(d), statistics.mean(d), statistics.mean(d[-max(1, len(d) // 4):])))
        if per_pair:
            cells = [f"{min(c):.2e}" + (f"-{max(c):.2e}" if len(per_pair) > 1 else "") for c in zip(*per_pair)]
            lines.append(f"| {side} vs stock | {len(per_pair)} | " + " | ".join(cells) + " |")
    return lines


def worker(a):
    import torch
    torch.manual_seed(0)
    if a.side == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama()  # what a Liger user adds before building the model
    model, loss_of, per_step, what = build(a.worker, torch)
    model = model.cuda().train()
    opt = adamw(torch, model.parameters(), a.side)
    stepped = torch.compile(model) if "compile" in a.side else model
    ms, losses = timed_steps(torch, stepped, loss_of, opt, a.warmup, a.steps)
    print(json.dumps({"model": a.worker, "side": a.side, "what": what, "ms": ms,
                      "per_step": per_step, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                      "losses": losses}))


KEPT_SETTINGS = ("TORCHFUSE_CACHE_DIR", "TORCHFUSE_LOG", "TORCHFUSE_LOG_FILE")


def side_env(side, lib_dir):
    """This process's environment without torchfuse's settings (its kernel cache's folder and its
    log settings kept: neither changes a result), and a side's own: for a side
    `torchfuse[...]` the library folder, for `torchfuse:SPEC` TORCHFUSE_OPS=SPEC, for
    `torchfuse+graphs` TORCHFUSE_LAYER_GRAPHS=1."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("TORCHFUSE") or k in KEPT_SETTINGS) and k != "LD_PRELOAD"}
    if side.startswith("torchfuse"):
        env["TORCHFUSE_LIB_DIR"] = str(Path(lib_dir).resolve())
        if ":" in side:
            env["TORCHFUSE_OPS"] = side.split(":", 1)[1].replace("/", ",")
        if "+graphs" in side:
            env["TORCHFUSE_LAYER_GRAPHS"] = "1"
    return env


def run(lib_dir, model, side, steps, warmup):
    cmd = [sys.executable, __file__, "--worker", model, "--side", side,
           "--steps", str(steps), "--warmup", str(warmup)]
    env = side_env(side, lib_dir)
    if side.startswith("torchfuse"):
        cmd = [str(ROOT / "scripts" / "torchfuse")] + cmd
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr, flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report(results, out, command):
    rows = []
    lines = [f"# Whole training steps of unchanged models\n\nCommand: `{command}`. Median step "
             "time over CUDA events after warm-up, the median over rounds; loss difference: the "
             "largest |loss - stock eager's loss| over the steps (same data and init) and over every "
             "pair of a run of the side and a stock run; in stock's row, stock against itself (its "
             "noise; nan with one stock run).\n",
             "| model | side | ms/step | speed-up vs stock eager | vs stock compile | "
             "samples or tokens/s | peak GiB | max loss diff |", "|---|---|---|---|---|---|---|---|"]
    for model, sides in results.items():
        med = {s: statistics.median(r["ms"] for r in runs) for s, runs in sides.items() if runs}
        stock = sides.get("stock") or []
        for side, runs in sides.items():
            if not runs:
                continue
            r, ms = runs[0], med[side]
            diff = max_loss_diff(runs, stock, side == "stock")
            vs_c = f"{med['compile'] / ms:.2f}x" if "compile" in med else "–"
            vs_s = f"{med['stock'] / ms:.2f}x" if "stock" in med else "–"
            what = r["what"] + model[len(r["model"]):]  # merged runs of other lengths: " (N losses)"
            lines.append(f"| {what} | {side} | {ms:.2f} | {vs_s} | {vs_c} | "
                         f"{r['per_step'] / ms * 1e3:,.0f} | {max(x['peak_gib'] for x in runs):.2f} | "
                         f"{diff:.2e} |")
            rows.append({"model": model, "side": side, "ms": ms, "rounds": [x["ms"] for x in runs],
                         "peak_gib": max(x["peak_gib"] for x in runs), "max_loss_diff": diff})
    for model, sides in results.items():
        lines += paired_lines(model, sides)
        lines += drift_lines(model, sides)
    (out / "bench_models.md").write_text("\n".join(lines) + "\n")
    (out / "bench_models.json").write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    print("\n".join(lines), flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    models = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    drawn = list(dict.fromkeys(r["side"] for r in rows if r["model"] in models and "ms" in r))
    for i, side in enumerate(drawn):
        ys = [next((r["ms"] for r in rows if r["model"] == m and r["side"] == "stock"), 0) /
              next((r["ms"] for r in rows if r["model"] == m and r["side"] == side), float("inf"))
              for m in models]
        ax.bar([j + i * 0.16 for j in range(len(models))], ys, 0.16, label=side)
    ax.set_xticks([j + 0.08 * (len(drawn) - 1) for j in range(len(models))], models)
    ax.set_ylabel("speed-up over stock eager")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_models.png", dpi=120)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lib-dir", default=str(ROOT / ".dev"))
    p.add_argument("--out", default="bench-out")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--merge", nargs="+", metavar="JSONL",
                   help="no runs: report the runs in these bench_models.jsonl files (several calls: "
                        "machines differ, so compare times within one call)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--side", default="stock", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        return worker(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python3 scripts/bench/bench_models.py " + " ".join(sys.argv[1:])
    if a.merge:
        return report(merged(a.merge), out, command)
    models, sides = a.models.split(","), a.sides.split(",")
    results = {m: {s: [] for s in sides} for m in models}
    runs_log = out / "bench_models.jsonl"  # every run as it ends: a cut-off call keeps its runs
    for rnd in range(a.rounds):
        for m in models:
            for s in sides:
                if s == "liger" and m not in LIGER_MODELS:
                    continue
                r = run(Path(a.lib_dir).resolve(), m, s, a.steps, a.warmup)
                print(f"round {rnd} {m} {s}: {r['ms']:.2f} ms" if r else f"round {rnd} {m} {s}: failed",
                      flush=True)
                if r:
                    results[m][s].append(r)
                    with runs_log.open("a") as f:
                        f.write(json.dumps(r) + "\n")
    report(results, out, command)


def merged(paths):
    """Results of several calls' bench_models.jsonl, runs in the order the files give them.
    Runs of one model with different numbers of losses (steps) are kept apart, as
    "model (N losses)": their losses cannot be paired step for step."""
    runs = [json.loads(line) for path in paths for line in Path(path).read_text().splitlines()]
    label = length_label(runs, lambda r: r["model"])
    results = {}
    for r in runs:
        results.setdefault(label(r), {}).setdefault(r["side"], []).append(r)
    return results


if __name__ == "__main__":
    main()
