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
