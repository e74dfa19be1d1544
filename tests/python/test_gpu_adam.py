"""Adam and AdamW (_fused_adam_ / _fused_adamw_) through torchfuse vs stock's fused kernel
and a float64 reference (docs/testing.md ("Correctness"): fp32 within 1e-6 relative after several steps)."""
import itertools
import random

import pytest
import torch

from conftest import requires_cuda
from gpu_util import enabled, fresh_seed, fused_count, load_torchfuse, rel_err, stats

pytestmark = requires_cuda

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Ours vs stock after several steps. fp32 per docs/testing.md; 16-bit storage rounds each step, so
# a one-ulp difference would show as ~2^-8 (bf16) or 2^-11 (f16) of one element.
TOL_VS_STOCK = {torch.float32: 1e-6, torch.bfloat16: 1e-3, torch.float16: 1e-4}
FLOOR = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}
OPS = {False: "_fused_adam_", True: "_fused_adamw_"}


@pytest.fixture(scope="module", autouse=True)
def torchfuse_loaded():
    load_torchfuse()


def fused_calls():
    ops = stats()["ops"]
    return sum(ops.get(name, {}).get("fused", 0)
               for name in ("_fused_adam_", "_fused_adam_.tensor_lr", "_fused_adamw_",
                            "_fused_adamw_.tensor_lr"))


def make_tensors(sizes, dtype, gen, misaligned=False, transposed=False):
    """Params and optimizer state as the fused optimizer keeps them (state dtype = param dtype,
    fp32 step counts on the device), with random non-zero values."""
    def rand(shape, scale=1.0, positive=False):
        t = torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale
        return (t.abs() if positive else t).to(dtype)

    def place(t):
        if misaligned:  # a view one element into its storage: not 16-byte aligned
            flat = torch.empty(t.numel() + 1, device="cuda", dtype=dtype)
            flat[1:].copy_(t.flatten())
            return flat[1:].view(t.shape)
        if transposed and t.dim() == 2:  # dense but not contiguous
            return t.t().contiguous().t()
        return t

    state = {k: [] for k in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")}
    for shape in sizes:
        state["params"].append(place(rand(shape)))
        state["grads"].append(place(rand(shape, 0.1)))
        state["exp_avgs"].append(place(rand(shape, 0.01)))
        state["exp_avg_sqs"].append(place(rand(shape, 1e-4, positive=True)))
        state["max_exp_avg_sqs"].append(place(rand(shape, 1e-4, positive=True)))
    state["steps"] = [torch.tensor(float(random.randint(0, 50)), device="cuda") for _ in sizes]
    return state


def clone_state(state):
    return {k: [t.clone() for t in v] for k, v in state.items()}


def run_step(state, cfg, on):
    """One optimizer step as torch.optim's fused path makes it: steps += 1, then the op."""
    torch._foreach_add_(state["steps"], 1)
    lr = cfg["lr"]
    if cfg["lr_kind"] == "cuda":
        lr = torch.tensor(lr, device="cuda")
    elif cfg["lr_kind"] == "cpu":
        lr = torch.tensor(lr)
    op = torch._fused_adamw_ if cfg["decoupled"] else torch._fused_adam_
    with enabled("adam", on):
        op(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"],
           state["max_exp_avg_sqs"] if cfg["amsgrad"] else [], state["steps"],
           lr=lr, beta1=cfg["beta1"], beta2=cfg["beta2"], weight_decay=cfg["weight_decay"],
           eps=cfg["eps"], amsgrad=cfg["amsgrad"], maximize=cfg["maximize"],
           grad_scale=cfg.get("grad_scale"), found_inf=cfg.get("found_inf"))


def reference_step(state, cfg):
    """The same step in float64 from the same stored values (what stock computes in fp32)."""
    out = {k: [] for k in ("params", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs")}
    b1, b2, lr, wd, eps = cfg["beta1"], cfg["beta2"], cfg["lr"], cfg["weight_decay"], cfg["eps"]
    for i, p in enumerate(state["params"]):
        p = p.double()
        g = state["grads"][i].double()
        m = state["exp_avgs"][i].double()
        v = state["exp_avg_sqs"][i].double()
        vmax = state["max_exp_avg_sqs"][i].double()
        step = state["steps"][i].item() + 1
        if cfg.get("grad_scale") is not None:
            g = g / cfg["grad_scale"].double()
        out["grads"].append(g)
        d = -g if cfg["maximize"] else g
        if wd != 0:
            if cfg["decoupled"]:
                p = p - lr * wd * p
            else:
                d = d + wd * p
        m = b1 * m + (1 - b1) * d
        v = b2 * v + (1 - b2) * d * d
        second = torch.maximum(vmax, v) if cfg["amsgrad"] else v
        bc1 = 1 - b1 ** step
        bc2 = 1 - b2 ** step
        p = p - (lr / bc1) * m / (second.sqrt() / bc2 ** 0.5 + eps)
        out["params"].append(p)
        out["exp_avgs"].append(m)
        out["exp_avg_sqs"].append(v)
        out["max_exp_avg_sqs"].append(torch.maximum(vmax, v))
    return out


def lists_err(a, b):
    """‖a − b‖ / ‖b‖ over whole lists; NaN/Inf must sit at the same places in both."""
    num = den = 0.0
    for x, y in zip(a, b):
        x, y = x.double(), y.double()
        finite = torch.isfinite(y)
        assert torch.equal(finite, torch.isfinite(x)), "NaN/Inf at different places"
        assert torch.equal(x[~finite].isnan(), y[~finite].isnan()), "NaN vs Inf"
        num += ((x - y)[finite] ** 2).sum().item()
        den += (y[finite] ** 2).sum().item()
    return (num / den) ** 0.5 if den > 0 else num ** 0.5


def compared_keys(cfg):
    keys = ["params", "exp_avgs", "exp_avg_sqs"]
    if cfg["amsgrad"]:
        keys.append("max_exp_avg_sqs")
    if cfg.get("grad_scale") is not None:
        keys.append("grads")  # stock writes the unscaled gradient back
    return keys


SIZES = [(1,), (3,), (7, 5), (64,), (1000,), (4099,), (33, 257), (128, 128)]


def config(decoupled, amsgrad, maximize, weight_decay, lr_kind, scaler, gen_seed, dtype=torch.float32):
    rnd = random.Random(gen_seed)
    cfg = dict(decoupled=decoupled, amsgrad=amsgrad, maximize=maximize, lr_kind=lr_kind,
               weight_decay=weight_decay, lr=rnd.choice([1e-3, 3e-4, 0.1]),
               beta1=rnd.choice([0.9, 0.8]), beta2=rnd.choice([0.999, 0.95]),
               eps=rnd.choice([1e-8, 1e-6]))
    if scaler != "none":
        # Scaled gradients must stay finite in the storage dtype (f16 tops out at 65504).
        scales = [1024.0, 3.0] if dtype == torch.float16 else [1024.0, 65536.0, 3.0]
        cfg["grad_scale"] = torch.tensor(rnd.choice(scales), device="cuda")
        cfg["found_inf"] = torch.tensor(1.0 if scaler == "inf" else 0.0, device="cuda")
    return cfg


FLAGS = list(itertools.product([False, True], [False, True], [False, True], [0.0, 0.1],
                               ["float", "cuda", "cpu"], ["none", "scale", "inf"]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_flag_combination_matches_stock_and_reference(dtype):
    seed = fresh_seed()
    print(f"seed {seed}")
    random.seed(seed)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    before = fused_calls()
    for flags in FLAGS:
        cfg = config(*flags, seed, dtype=dtype)
        ours = make_tensors(SIZES, dtype, gen)
        theirs = clone_state(ours)
        if cfg.get("grad_scale") is not None:
            for s in (ours, theirs):
                s["grads"] = [g * cfg["grad_scale"].to(dtype) for g in s["grads"]]
        # The first step also against the float64 reference.
        first_inputs = clone_state(ours)
        run_step(ours, cfg, True)
        run_step(theirs, cfg, False)
        if cfg.get("found_inf") is not None and cfg["found_inf"].item() == 1.0:
            for key in compared_keys(cfg):
                for a, b in zip(ours[key], first_inputs[key]):
                    assert torch.equal(a, b), f"{flags}: found_inf=1 changed {key}"
            continue
        ref = reference_step(first_inputs, cfg)
        for key in compared_keys(cfg):
            ours_err = lists_err(ours[key], ref[key])
            stock_err = lists_err(theirs[key], ref[key])
            assert ours_err <= max(2 * stock_err, FLOOR[dtype]), (
                f"{flags} {key}: ours {ours_err:.3g} vs reference, stock {stock_err:.3g}")
        # More steps with fresh gradients, then ours against stock.
        for _ in range(3):
            grads = [(torch.randn(g.shape, generator=gen, device="cuda") * 0.1).to(dtype)
                     for g in ours["grads"]]
            for s in (ours, theirs):
                for g, new in zip(s["grads"], grads):
                    g.copy_(new * cfg["grad_scale"].to(dtype) if "grad_scale" in cfg else new)
            run_step(ours, cfg, True)
            run_step(theirs, cfg, False)
        for key in compared_keys(cfg):
            err = lists_err(ours[key], theirs[key])
            assert err <= TOL_VS_STOCK[dtype], f"{flags} {key}: {err:.3g} from stock after 4 steps"
        assert all(torch.equal(a, b) for a, b in zip(ours["steps"], theirs["steps"]))
    # Every call of ours (4 per combination that is not skipped by found_inf, 1 otherwise).
    expected = sum(1 if f[-1] == "inf" else 4 for f in FLAGS)
    assert fused_calls() - before == expected


@pytest.mark.parametrize("layout", ["misaligned", "transposed"])
def test_unaligned_and_non_contiguous_tensors(layout):
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    for dtype in DTYPES:
        cfg = config(True, True, False, 0.01, "float", "scale", 1, dtype=dtype)
        ours = make_tensors(SIZES, dtype, gen, misaligned=layout == "misaligned",
                            transposed=layout == "transposed")
        theirs = clone_state(ours)
        before = fused_calls()
        for _ in range(3):
            run_step(ours, cfg, True)
            run_step(theirs, cfg, False)
        assert fused_calls() - before == 3
        for key in compared_keys(cfg):
            assert lists_err(ours[key], theirs[key]) <= TOL_VS_STOCK[dtype], (layout, dtype, key)


def test_more_tensors_than_one_launch_carries():
    """1,234 tensors of 1 to 3000 elements: three launches; every tensor updated once."""
    rnd = random.Random(fresh_seed())
    sizes = [(rnd.randint(1, 3000),) for _ in range(1234)]
    gen = torch.Generator(device="cuda").manual_seed(rnd.randint(0, 2**31))
    cfg = config(False, False, False, 0.1, "cuda", "none", 2)
    ours = make_tensors(sizes, torch.float32, gen)
    theirs = clone_state(ours)
    run_step(ours, cfg, True)
    run_step(theirs, cfg, False)
    for key in compared_keys(cfg):
        worst = max(rel_err(a, b) for a, b in zip(ours[key], theirs[key]))
        assert worst <= 1e-6, key


def test_empty_tensors_in_the_list():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    cfg = config(True, False, False, 0.0, "float", "none", 3)
    ours = make_tensors([(0,), (17,), (0, 4), (300,)], torch.float32, gen)
    theirs = clone_state(ours)
    run_step(ours, cfg, True)
    run_step(theirs, cfg, False)
    for key in compared_keys(cfg):
        assert lists_err(ours[key], theirs[key]) <= 1e-6
    # (Empty lists never reach a CUDA kernel: the dispatcher has no tensor to dispatch on.)


def test_a_tensor_of_more_than_2_to_the_31_elements():
    """64-bit offsets: the elements past 2^31 are updated like the first ones."""
    n = 2**31 + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < 4 * n * 2 + (2 << 30):
        pytest.skip(f"needs {4 * n * 2 / 2**30:.0f} GiB free on the GPU")
    dtype = torch.bfloat16
    cfg = config(True, False, False, 0.1, "float", "none", 4)
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    state = {
        "params": [torch.randn(n, generator=gen, device="cuda", dtype=dtype)],
        "grads": [torch.randn(n, generator=gen, device="cuda", dtype=dtype)],
        "exp_avgs": [torch.randn(n, generator=gen, device="cuda", dtype=dtype) * 0.01],
        "exp_avg_sqs": [torch.rand(n, generator=gen, device="cuda", dtype=dtype) * 1e-4],
        "max_exp_avg_sqs": [],
        "steps": [torch.tensor(7.0, device="cuda")],
    }
    pieces = [slice(0, 4096), slice(2**31 - 1000, 2**31 + 1000), slice(n - 5000, n)]
    inputs = [{k: [t[piece].clone() for t in v] if k != "steps" else [s.clone() for s in v]
               for k, v in state.items()} for piece in pieces]
    for piece_state in inputs:
        piece_state["max_exp_avg_sqs"] = [torch.zeros_like(piece_state["params"][0])]
    before = fused_calls()
    run_step(state, cfg, True)
    assert fused_calls() - before == 1
    for piece, piece_inputs in zip(pieces, inputs):
        expected = clone_state(piece_inputs)
        run_step(expected, cfg, False)  # stock on the same slice of inputs
        for key in ("params", "exp_avgs", "exp_avg_sqs"):
            assert torch.equal(state[key][0][piece], expected[key][0]) or \
                rel_err(state[key][0][piece], expected[key][0]) <= TOL_VS_STOCK[dtype], (piece, key)


def test_cuda_graph_capture_replays_like_eager_stock():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    cfg = config(True, False, False, 0.01, "cuda", "scale", 5)
    cfg["found_inf"].zero_()
    static = make_tensors(SIZES, torch.float32, gen)
    eager = clone_state(static)
    lr = torch.tensor(cfg["lr"], device="cuda")

    def step(state):
        torch._foreach_add_(state["steps"], 1)
        torch._fused_adamw_(state["params"], state["grads"], state["exp_avgs"], state["exp_avg_sqs"],
                            [], state["steps"], lr=lr, beta1=cfg["beta1"], beta2=cfg["beta2"],
                            weight_decay=cfg["weight_decay"], eps=cfg["eps"], amsgrad=False,
                            maximize=False, grad_scale=cfg["grad_scale"], found_inf=cfg["found_inf"])

    # Warm up (compiles and loads the kernel) on a throwaway copy, then capture.
    scratch = clone_state(static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(scratch)
    torch.cuda.current_stream().wait_stream(side)
    before = fused_calls()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static)
    assert fused_calls() - before == 1
    for i in range(4):
        grads = [torch.randn(g.shape, generator=gen, device="cuda") * 64 for g in static["grads"]]
        for g, new in zip(static["grads"], grads):
            g.copy_(new)
        for g, new in zip(eager["grads"], grads):
            g.copy_(new)
        lr.fill_(cfg["lr"] * (i + 1))  # the captured step reads the device lr
        graph.replay()
        with enabled("adam", False):
            step(eager)
    torch.cuda.synchronize()
    for key in ("params", "exp_avgs", "exp_avg_sqs", "grads", "steps"):
        assert lists_err(static[key], eager[key]) <= 1e-6, key


def test_unsupported_calls_go_to_stock_with_stocks_result():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    cfg = config(False, False, False, 0.0, "float", "none", 6)
    # float64: stock's kernel serves it.
    ours = make_tensors(SIZES, torch.float64, gen)
    theirs = clone_state(ours)
    run_step(ours, cfg, True)
    run_step(theirs, cfg, False)
    for key in compared_keys(cfg):
        assert all(torch.equal(a, b) for a, b in zip(ours[key], theirs[key]))
    assert stats()["ops"]["_fused_adam_"]["stock_reasons"].get("unsupported dtype", 0) >= 1


def stock_error(fn):
    with pytest.raises(Exception) as on:
        fn(True)
    with pytest.raises(Exception) as off:
        fn(False)
    return on.value, off.value


def test_bad_input_gets_stocks_error():
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    cfg = config(False, False, False, 0.0, "float", "none", 7)

    def mismatched_dtype(on):
        s = make_tensors(SIZES, torch.float32, gen)
        s["exp_avgs"][2] = s["exp_avgs"][2].bfloat16()
        run_step(s, cfg, on)

    def mismatched_shape(on):
        s = make_tensors(SIZES, torch.float32, gen)
        s["grads"][1] = s["grads"][1][:2]
        run_step(s, cfg, on)

    def lr_on_cpu_grad_scale_f64(on):
        s = make_tensors(SIZES, torch.float32, gen)
        c = dict(cfg, grad_scale=torch.tensor(2.0, device="cuda", dtype=torch.float64))
        run_step(s, c, on)

    for case in (mismatched_dtype, mismatched_shape, lr_on_cpu_grad_scale_f64):
        with_tf, without = stock_error(case)
        assert type(with_tf) is type(without), case.__name__
        assert str(with_tf).splitlines()[0] == str(without).splitlines()[0], case.__name__


def train(model_seed, data_seed, optimizer_factory, steps, amp_scaler=False, inf_at=None):
    torch.manual_seed(model_seed)
    model = torch.nn.Sequential(torch.nn.Linear(96, 256), torch.nn.GELU(), torch.nn.LayerNorm(256),
                                torch.nn.Linear(256, 10)).cuda()
    opt = optimizer_factory(model.parameters())
    scaler = torch.amp.GradScaler("cuda") if amp_scaler else None
    gen = torch.Generator(device="cuda").manual_seed(data_seed)
    for i in range(steps):
        x = torch.randn(64, 96, generator=gen, device="cuda")
        y = torch.randint(0, 10, (64,), generator=gen, device="cuda")
        opt.zero_grad()
        if scaler is None:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        else:
            with torch.autocast("cuda", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if i == inf_at:
                next(model.parameters()).grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("amp", [False, True])
def test_torch_optim_fused_adamw_trains_like_stock(amp):
    seeds = (fresh_seed(), fresh_seed())

    def factory(params):
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.05, fused=True)

    before = fused_calls()
    ours, _ = train(*seeds, factory, 8, amp_scaler=amp, inf_at=3 if amp else None)
    assert fused_calls() > before
    with enabled("adam", False):
        theirs, _ = train(*seeds, factory, 8, amp_scaler=amp, inf_at=3 if amp else None)
    assert lists_err(ours, theirs) <= 1e-6


@pytest.mark.parametrize("amsgrad", [False, True])
def test_lists_of_different_lengths_are_an_error_not_a_crash(amsgrad):
    """Stock's kernel reads past the shorter list (the process dies); torchfuse refuses the
    call with an error that names the lists, whether its adam toggle is on or off."""
    gen = torch.Generator(device="cuda").manual_seed(fresh_seed())
    cfg = config(False, amsgrad, False, 0.0, "float", "none", 8)
    for short in (["exp_avg_sqs", "steps"] + (["max_exp_avg_sqs"] if amsgrad else [])):
        for on in (True, False):
            s = make_tensors(SIZES, torch.float32, gen)
            s[short].pop()
            with pytest.raises(RuntimeError, match="must have the same number of tensors, got"):
                run_step(s, cfg, on)
    # Without amsgrad, stock does not read max_exp_avg_sqs: any length is accepted.
    if not amsgrad:
        s = make_tensors(SIZES, torch.float32, gen)
        before = fused_calls()
        with enabled("adam", True):
            torch._fused_adam_(s["params"], s["grads"], s["exp_avgs"], s["exp_avg_sqs"],
                               s["max_exp_avg_sqs"][:3], s["steps"], lr=1e-3, beta1=0.9,
                               beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
                               maximize=False)
        assert fused_calls() - before == 1


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("tensor_lr", [False, True])
@pytest.mark.parametrize("amsgrad,maximize", [(False, False), (True, True)])
def test_fp32_steps_are_bitwise_identical_to_stock(cls, tensor_lr, amsgrad, maximize):
    """The element math is stock's, rounding for rounding: same bits after several steps.
    (Adam's L2 term, weight decay added to the gradient, is left out: stock's compiled form of
    it rounds like neither one FMA nor a multiply and an add, so it is only within tolerance,
    which test_every_flag_combination_matches_stock_and_reference checks.)"""
    seed = fresh_seed()
    weight_decay = 0.01 if cls is torch.optim.AdamW else 0.0

    def fn():
        gen = torch.Generator(device="cuda").manual_seed(seed)
        params = [torch.randn(s, generator=gen, device="cuda", requires_grad=True)
                  for s in ((64, 33), (7,), (1,), (4099,))]
        lr = torch.tensor(1e-3, device="cuda") if tensor_lr else 1e-3
        opt = cls(params, lr=lr, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                  fused=True)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen, device="cuda")
            opt.step()
        return [t for p in params for t in (p.detach(), *opt.state[p].values())]

    name = ("_fused_adamw_" if cls is torch.optim.AdamW else "_fused_adam_") + (".tensor_lr" if tensor_lr else "")
    before = fused_count(name)
    ours = fn()
    assert stats()["ops"][name]["fused"] == before + 3
    with enabled("adam", False):
        theirs = fn()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b), f"max |diff| {(a.double() - b.double()).abs().max().item():.3g}"
