"""Issue 40 probe, before any product code: can cuBLASLt's GELU epilogues take GPT-2's MLP
passes into its GEMMs, at HF Conv1D's layouts, faster than stock and within the error contract?

GPT-2's MLP at batch 32 x 1024 (M tokens, C = 768, H = 3072), HF's Conv1D weights [in, out]:
  forward:  pre = x @ W_fc + b_fc, h = gelu_tanh(pre)       (stock: addmm, then the GELU's pass)
  backward: g_pre = gelu_tanh'(pre) * (g_y @ W_proj^T), db_fc = g_pre.sum(0)
            (stock: mm, gelu_backward's pass, the bias gradient's column sum)
cuBLASLt, column-major (row-major [M, H] is column-major H x M):
  forward:  GELU_AUX_BIAS, A = W_fc (H x C, N), B = x (C x M, N); aux = pre
  backward: DGELU / DGELU_BGRAD, A = W_proj (C x H, T), B = g_y (C x M, N); aux = pre

Prints per pass: whether cuBLASLt has an algorithm for it, µs per call (CUDA events, medians),
the error against a float64 reference from the same inputs next to stock's (DESIGN's contract:
ours <= max(2 x stock's, 8e-3) for bf16), and whether two runs give the same bits.

  python3 scripts/dev/cublaslt_gelu_probe.py [--tokens 32768]
"""
import argparse
import ctypes
import math
import statistics

import torch
import torch.nn.functional as F

# cublasLt.h (CUDA 13.0) values.
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
OP_N, OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
DESC_AUX_POINTER, DESC_AUX_LD = 11, 12
PREF_MAX_WORKSPACE_BYTES = 1
EPILOGUE = {"gelu_aux_bias": 164, "dgelu": 192, "dgelu_bgrad": 208}
WORKSPACE = 32 << 20


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t),
                ("state", ctypes.c_int), ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class Lt:
    """The few cuBLASLt calls a bf16 GEMM with an epilogue needs, through ctypes."""

    def __init__(self):
        self.lib = ctypes.CDLL("libcublasLt.so.13")  # torch's own copy, already loaded
        self.lib.cublasLtGetStatusName.restype = ctypes.c_char_p
        self.handle = ctypes.c_void_p()
        self.check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = torch.empty(WORKSPACE, dtype=torch.uint8, device="cuda")

    def check(self, status, what):
        if status != 0:
            raise RuntimeError(f"{what}: {self.lib.cublasLtGetStatusName(status).decode()}")

    def layout(self, rows, cols, ld):
        out = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(out), ctypes.c_int(R_16BF), ctypes.c_uint64(rows),
                                                       ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
        return out

    def gemm(self, a, a_shape, trans_a, b, b_shape, d, m, n, epilogue, bias=None, aux=None):
        """A callable running D (m x n, column-major, ld m) = op(A) op(B) with the epilogue; A and
        B given as (column-major rows, cols) of their storage, B never transposed."""
        desc = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatmulDescCreate(ctypes.byref(desc), ctypes.c_int(COMPUTE_32F), ctypes.c_int(R_32F)), "desc")

        def attr(which, value):
            self.check(self.lib.cublasLtMatmulDescSetAttribute(desc, ctypes.c_int(which), ctypes.byref(value),
                                                               ctypes.c_size_t(ctypes.sizeof(value))), f"attr {which}")
        attr(DESC_TRANSA, ctypes.c_int32(trans_a))
        attr(DESC_TRANSB, ctypes.c_int32(OP_N))
        attr(DESC_EPILOGUE, ctypes.c_uint32(EPILOGUE[epilogue]))
        if bias is not None:
            attr(DESC_BIAS_POINTER, ctypes.c_void_p(bias.data_ptr()))
        if aux is not None:
            attr(DESC_AUX_POINTER, ctypes.c_void_p(aux.data_ptr()))
            attr(DESC_AUX_LD, ctypes.c_int64(m))
        a_desc, b_desc, d_desc = self.layout(*a_shape, a_shape[0]), self.layout(*b_shape, b_shape[0]), self.layout(m, n, m)
        pref = ctypes.c_void_p()
        self.check(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        size = ctypes.c_uint64(WORKSPACE)
        self.check(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, ctypes.c_int(PREF_MAX_WORKSPACE_BYTES),
                                                                 ctypes.byref(size), ctypes.c_size_t(8)), "pref attr")
        found, count = Heuristic(), ctypes.c_int(0)
        self.check(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a_desc, b_desc, d_desc, d_desc, pref,
                                                           ctypes.c_int(1), ctypes.byref(found), ctypes.byref(count)),
                   f"heuristic ({epilogue})")
        if count.value < 1:
            raise RuntimeError(f"no algorithm ({epilogue})")
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        keep = (desc, a_desc, b_desc, d_desc, pref, found, alpha, beta)  # alive as long as the callable

        def run():
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            self.check(self.lib.cublasLtMatmul(
                self.handle, desc, ctypes.byref(alpha), ctypes.c_void_p(a.data_ptr()), a_desc,
                ctypes.c_void_p(b.data_ptr()), b_desc, ctypes.byref(beta), ctypes.c_void_p(d.data_ptr()), d_desc,
                ctypes.c_void_p(d.data_ptr()), d_desc, ctypes.byref(found.algo), ctypes.c_void_p(self.workspace.data_ptr()),
                ctypes.c_size_t(WORKSPACE), stream), f"matmul ({epilogue})")
        run.keep = keep
        return run


def us_per_call(fn, reps=20, rounds=7):
    times = []
    for _ in range(rounds):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3 / reps)
    return statistics.median(times)


def gelu_tanh64(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_tanh_grad64(x):
    inner = math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * x * x)


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, default=32768)
    a = p.parse_args()
    M, C, H = a.tokens, 768, 3072
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(M, C, generator=g, **bf)
    w_fc, b_fc = torch.randn(C, H, generator=g, **bf) * 0.02, torch.randn(H, generator=g, **bf) * 0.02
    w_proj, g_y = torch.randn(H, C, generator=g, **bf) * 0.02, torch.randn(M, C, generator=g, **bf)
    lt = Lt()
    print(f"# cuBLASLt GELU epilogues at GPT-2's MLP, {M} tokens ({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print("| pass | stock µs | cuBLASLt µs | ratio | rel. error stock | rel. error cuBLASLt | same bits twice |")
    print("|---|---|---|---|---|---|---|")

    # Forward.
    pre_ref = x.double() @ w_fc.double() + b_fc.double()
    h_ref = gelu_tanh64(pre_ref)

    def stock_fwd():
        return F.gelu(torch.addmm(b_fc, x, w_fc), approximate="tanh")
    h_stock, pre = stock_fwd(), torch.addmm(b_fc, x, w_fc)
    h_lt, aux = torch.empty(M, H, **bf), torch.empty(M, H, **bf)
    try:
        fwd = lt.gemm(w_fc, (H, C), OP_N, x, (C, M), h_lt, H, M, "gelu_aux_bias", bias=b_fc, aux=aux)
        fwd()
        first = h_lt.clone()
        fwd()
        t_stock, t = us_per_call(stock_fwd), us_per_call(fwd)
        print(f"| fwd: addmm + gelu vs GELU_AUX_BIAS | {t_stock:.1f} | {t:.1f} | {t_stock / t:.2f}x | "
              f"{rel(h_stock, h_ref):.2e} | {rel(h_lt, h_ref):.2e} | {torch.equal(first, h_lt)} |")
        print(f"  aux == stock's addmm bits: {torch.equal(aux, pre)}; aux rel. error {rel(aux, pre_ref):.2e} "
              f"(stock's addmm {rel(pre, pre_ref):.2e}); h == gelu(bf16 pre) bits: {torch.equal(h_lt, h_stock)}, "
              f"max |diff| {(h_lt.float() - h_stock.float()).abs().max().item():.3e}")
    except RuntimeError as e:
        print(f"| fwd: GELU_AUX_BIAS | {us_per_call(stock_fwd):.1f} | {e} | | | | |")
    print(f"  addmm alone: {us_per_call(lambda: torch.addmm(b_fc, x, w_fc)):.1f} µs")

    # Backward.
    g_h_ref = g_y.double() @ w_proj.double().t()
    g_pre_ref = g_h_ref * gelu_tanh_grad64(pre_ref)
    db_ref = g_pre_ref.sum(0)

    def stock_bwd():
        g_pre = torch.ops.aten.gelu_backward(torch.mm(g_y, w_proj.t()), pre, approximate="tanh")
        return g_pre, g_pre.sum(0)
    g_pre_stock, db_stock = stock_bwd()
    t_stock = us_per_call(stock_bwd)
    print(f"  stock's backward parts: mm {us_per_call(lambda: torch.mm(g_y, w_proj.t())):.1f} µs, "
          f"+ gelu_backward + sum {t_stock:.1f} µs in all")
    for epilogue in ("dgelu", "dgelu_bgrad"):
        g_pre_lt, db_lt = torch.empty(M, H, **bf), torch.zeros(H, **bf)
        try:
            bwd = lt.gemm(w_proj, (C, H), OP_T, g_y, (C, M), g_pre_lt, H, M, epilogue,
                          bias=db_lt if epilogue == "dgelu_bgrad" else None, aux=pre)
        except RuntimeError as e:
            print(f"| bwd: {epilogue.upper()} | {t_stock:.1f} | {e} | | | | |")
            continue
        if epilogue == "dgelu":
            def fused():
                bwd()
                return g_pre_lt.sum(0)
        else:
            def fused():
                bwd()
                return db_lt
        db = fused().clone()
        first = g_pre_lt.clone()
        db2 = fused()
        t = us_per_call(fused)
        print(f"| bwd: mm + gelu_backward + sum vs {epilogue.upper()}{' + sum' if epilogue == 'dgelu' else ''} | {t_stock:.1f} | "
              f"{t:.1f} | {t_stock / t:.2f}x | {rel(g_pre_stock, g_pre_ref):.2e} | {rel(g_pre_lt, g_pre_ref):.2e} | "
              f"{torch.equal(first, g_pre_lt) and torch.equal(db, db2)} |")
        print(f"  its bias gradient: rel. error {rel(db, db_ref):.2e} (stock's {rel(db_stock, db_ref):.2e})")


if __name__ == "__main__":
    main()
