"""profile_step.py's GPU time by kind (no GPU needed): each op's self device time lands in the
kind issue 40 tracks (matmuls, attention, autocast's casts and copies, cats, ...), once."""
import sys

from conftest import ROOT


def test_ops_are_grouped_by_kind_each_once():
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import profile_step
    finally:
        sys.path.pop(0)
    rows = [("aten::mm", 10.0), ("aten::addmm", 5.0), ("aten::_cudnn_attention_backward", 4.0),
            ("aten::_scaled_dot_product_flash_attention", 1.0), ("aten::copy_", 3.0),
            ("aten::clone", 1.0), ("aten::cat", 2.0), ("aten::_fused_adamw_", 4.0),
            ("aten::_foreach_mul_", 1.0), ("aten::native_layer_norm_backward", 2.0),
            ("aten::_fused_rms_norm", 1.0), ("torchfuse::cross_entropy_bwd", 1.0),
            ("torchfuse::rotary", 0.5), ("aten::mul", 2.0), ("aten::embedding_dense_backward", 0.5)]
    kinds = profile_step.gpu_time_by_kind(rows)
    assert kinds == {"matmul": 15.0, "attention": 5.0, "casts and copies": 4.0, "cat": 2.0,
                     "optimizer": 5.0, "norms": 3.0, "cross-entropy": 1.0,
                     "torchfuse's other ops": 0.5, "other": 2.5}
    assert sum(kinds.values()) == sum(us for _, us in rows)


def test_python_profile_splits_the_steps_host_time_by_phase_and_area(capsys):
    """--python on a CPU step: the host wall of the forward, backward and optimizer phases, the
    profiled Python time by area (the backward's C++ engine apart from Python's own), and the
    largest functions, with the steps' call counts."""
    import torch
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import profile_step
    finally:
        sys.path.pop(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    profile_step.python_profile(step, 3, 5, sync=lambda: None)
    out = capsys.readouterr().out.splitlines()
    phases = out[0]
    assert phases.startswith("host wall of one step") and all(
        f"{p} " in phases for p in ("forward", "backward", "optimizer and the rest")), out
    assert out[1].startswith("profiled Python time") and "backward (C++ engine, hooks)" in out[1], out
    assert "torch's Python" in out[1], out
    table = out[3:]
    assert len(table) == 5 and all(len(row.split()) >= 3 for row in table), out
    # A step whose backward does not go through Tensor.backward is timed whole, and says so.
    profile_step.python_profile(lambda: torch.autograd.grad(model(torch.randn(4, 8)).sum(), list(model.parameters())),
                                1, 1, sync=lambda: None)
    assert "the whole step (no Tensor.backward seen)" in capsys.readouterr().out.splitlines()[0]
    # torch.Tensor.backward is itself restored after the timed step.
    assert torch.Tensor.backward.__name__ == "backward" and torch.Tensor.backward.__module__ == "torch._tensor"


def test_profile_areas_name_where_the_code_lives():
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import profile_step
    finally:
        sys.path.pop(0)
    roots = [("/x/python/torchfuse/", "torchfuse's Python"), ("/v/site-packages/transformers/", "transformers"),
             ("/v/site-packages/torch/", "torch's Python")]

    def area(filename, name="forward"):
        return profile_step.area_of(filename, name, roots)
    assert area("~", "<method 'run_backward' of 'torch._C._EngineBase' objects>") == "backward (C++ engine, hooks)"
    assert area("~", "<built-in method linear of PyCapsule object>") == "torch C++ and builtins called from Python"
    assert area("/x/python/torchfuse/rewrites.py") == "torchfuse's Python"
    assert area("/v/site-packages/transformers/models/llama/modeling_llama.py") == "transformers"
    assert area("/v/site-packages/torch/nn/modules/module.py", "_call_impl") == "torch's Python"
    # A path that only contains a package's name elsewhere is not that package's.
    assert area("/home/u/.cache/torchfuse/venv/x.py") == "other Python (the bench's loop)"
    assert area("/x/scripts/bench/bench_models.py", "train_step") == "other Python (the bench's loop)"
    # The installed packages are found by default.
    import torch
    assert profile_step.area_of(torch.nn.modules.module.__file__, "_call_impl") == "torch's Python"


def test_idle_gaps_split_the_gpus_own_latency_from_a_late_host():
    """--gaps on a made-up trace: three kernels on two streams, one launched before the GPU went
    idle (its gap is the GPU's own), one launched after (the host's, under the outermost op
    running on the launching thread); overlapping work on two streams leaves no gap."""
    sys.path.insert(0, str(ROOT / "scripts" / "bench"))
    try:
        import profile_step
    finally:
        sys.path.pop(0)

    def kernel(ts, dur, corr, cat="kernel"):
        return {"cat": cat, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    def launch(ts, corr, tid=1):
        return {"cat": "cuda_runtime", "ts": ts, "dur": 2, "tid": tid, "args": {"correlation": corr}}

    def op(name, ts, dur, tid=1):
        return {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid}
    events = [
        op("aten::linear", 0, 12), op("aten::addmm", 1, 10),
        op("autograd::engine::evaluate_function: MmBackward0", 40, 30, tid=2), op("aten::mm", 45, 20, tid=2),
        op("aten::mm", 50, 1),  # another thread's op around the same time: not the launcher's
        launch(2, 1), kernel(10, 20, 1),              # busy 10..30
        launch(3, 2), kernel(12, 25, 2),              # another stream, overlapping: busy to 37
        launch(5, 3), kernel(40, 5, 3, "gpu_memset"),  # queued at 5, ran at 40: 3 us of the GPU's own
        launch(50, 4, tid=2), kernel(60, 5, 4),       # launched at 50, after the GPU went idle at 45
        launch(64, 5), kernel(70, 1, 5),              # launch began before idle (65), returned after
    ]
    gaps = profile_step.idle_gaps(events)
    assert gaps == [(3, False, None), (15, True, "autograd::engine::evaluate_function: MmBackward0"),
                    (5, True, None)]
