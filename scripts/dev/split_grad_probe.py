"""Issue 40: GPT-2's c_attn gradient made of q's, k's and v's at B8 and B32 (S1024, 12 heads of
64, bf16), two ways with the same bits: stock's (each transposed back and reshaped, then one
cat: SplitBackward0's) against one strided copy of each into its columns. CUDA events, medians
of 50 calls. q's gradient as cuDNN's attention backward gives it ([B, H, S, D]), k's and v's in
token order (as kv_copy's backward gives them).

  python3 scripts/dev/split_grad_probe.py
"""
import torch


def median_us(fn, n=50):
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(n):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def main():
    for batch in (8, 32):
        seq, heads, head_dim = 1024, 12, 64
        bf16 = dict(device="cuda", dtype=torch.bfloat16)
        dq = torch.randn(batch, heads, seq, head_dim, **bf16)
        dk = torch.randn(batch, seq, heads, head_dim, **bf16).transpose(1, 2)
        dv = torch.randn(batch, seq, heads, head_dim, **bf16).transpose(1, 2)

        def stock():
            return torch.cat([g.transpose(1, 2).reshape(batch, seq, heads * head_dim) for g in (dq, dk, dv)],
                             dim=-1)

        def column_copies():
            out = torch.empty(batch, seq, 3 * heads * head_dim, **bf16)
            for i, g in enumerate((dq, dk, dv)):
                out.narrow(-1, i * heads * head_dim, heads * head_dim).view(
                    batch, seq, heads, head_dim).copy_(g.transpose(1, 2))
            return out

        assert torch.equal(stock(), column_copies())
        print(f"B{batch}: stock reshape+cat {median_us(stock):.1f} us, column copies {median_us(column_copies):.1f} us")


if __name__ == "__main__":
    main()
