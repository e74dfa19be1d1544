//! Embedding forward (`embedding`) and backward (`embedding_dense_backward`) through
//! kernels/embedding.cu, or why stock runs a call. Calls stock would reject go to stock, so
//! the user gets stock's error; out-of-range indices stop our kernels with a device-side
//! assert, as they stop stock's.

use super::params::{self, flag};
use super::{Family, KernelOp, Request, Selected, Served, Variant};
use crate::abi::tensor::{aligned16, describe, device_addr, empty};
use crate::abi::types::{TfEmbeddingCall, TfTensor};
use crate::gpu::args::{self, kernel_args, Field, KernelArgs};
use crate::gpu::{self, Launch};
use crate::runtime::{Entry, OpFamily};
use crate::select::{dtype_of, StockReason};
use cudarc::driver::{DriverError, LaunchConfig};
use serde::{Deserialize, Serialize};
use tch::{Kind, Tensor};

/// Tokens per thread of a radix sort tile (`SORT_ITEMS_SMALL` up to `SMALL_TILES_MAX_TOKENS`
/// tokens, `SORT_ITEMS_LARGE` above: measured at 16384 tokens, 1024-token tiles took 77.6 ->
/// 71.4 us at GPT-2's shape; at 131072, 166.7 -> 179.3 us), its block size, and the widest
/// digit.
const SORT_ITEMS_SMALL: i32 = 4;
const SORT_ITEMS_LARGE: i32 = 8;
const SMALL_TILES_MAX_TOKENS: i64 = 16384;
const SORT_THREADS: u32 = 256;
const MAX_DIGIT_BITS: u32 = 9;
/// Sorted tokens per chunk of emb_bwd_reduce (`CHUNK`), and the two kernels' block sizes.
const CHUNK: i64 = 32;
const REDUCE_THREADS: u32 = 256;
const FINISH_THREADS: u32 = 512;
/// Column vectors one thread of emb_zero_rows stores per round (the kernel's ZERO_UNROLL).
const ZERO_UNROLL: i64 = 4;
/// The one-launch sort on a thread-block cluster (`emb_sort_cluster`, sm 90; variants with
/// `SORT_CLUSTER = 1`): CTAs per cluster, threads per CTA, most tokens per thread, and its
/// dynamic shared memory (the kernel's CSORT_SMEM_BYTES: two buffers of (key, token) pairs; the
/// per-warp digit counts, every tile's counts in two slots and the tile's own; the warps'
/// totals; three mbarriers).
const CLUSTER_SORT_CTAS: u32 = 8;
const CLUSTER_SORT_THREADS: u32 = 512;
const CLUSTER_SORT_ITEMS_MAX: i64 = 8;
const CLUSTER_SORT_SMEM: u32 = {
    let tile = CLUSTER_SORT_THREADS * CLUSTER_SORT_ITEMS_MAX as u32;
    let warps = CLUSTER_SORT_THREADS / 32;
    2 * tile * 8
        + (warps + 2 * CLUSTER_SORT_CTAS + 1) * (1 << MAX_DIGIT_BITS) * 4
        + warps * 4
        + 3 * 8
};
/// The most tokens the cluster sort takes.
pub const CLUSTER_SORT_MAX_TOKENS: i64 =
    CLUSTER_SORT_CTAS as i64 * CLUSTER_SORT_THREADS as i64 * CLUSTER_SORT_ITEMS_MAX;
/// emb_mark_rows' threads per CTA (one cluster of CLUSTER_SORT_CTAS) and tokens per thread.
const MARK_THREADS: u32 = 1024;
const MARK_ITEMS: i64 = 4;
const _: () =
    assert!(CLUSTER_SORT_CTAS as i64 * MARK_THREADS as i64 * MARK_ITEMS >= CLUSTER_SORT_MAX_TOKENS);

/// The constants kernels/embedding.cu shares with this file, passed as `-DTF_EMB_<NAME>`
/// (the kernel `#error`s without them).
const SHARED: [(&str, i64); 15] = [
    ("SORT_THREADS", SORT_THREADS as i64),
    ("SORT_ITEMS_SMALL", SORT_ITEMS_SMALL as i64),
    ("SORT_ITEMS_LARGE", SORT_ITEMS_LARGE as i64),
    ("MAX_DIGIT_BITS", MAX_DIGIT_BITS as i64),
    ("CHUNK", CHUNK),
    ("REDUCE_THREADS", REDUCE_THREADS as i64),
    ("FINISH_THREADS", FINISH_THREADS as i64),
    ("ZERO_UNROLL", ZERO_UNROLL),
    ("ZERO_SLICE", ZERO_SLICE),
    ("CLUSTER_SORT_CTAS", CLUSTER_SORT_CTAS as i64),
    ("CLUSTER_SORT_THREADS", CLUSTER_SORT_THREADS as i64),
    ("CLUSTER_SORT_ITEMS_MAX", CLUSTER_SORT_ITEMS_MAX),
    ("CLUSTER_SORT_SMEM", CLUSTER_SORT_SMEM as i64),
    ("MARK_THREADS", MARK_THREADS as i64),
    ("MARK_ITEMS", MARK_ITEMS),
];

/// The kernels of kernels/embedding.cu, by name. The forward's gather; the backward's launch
/// sort (count, scatter), one-cluster sort and its row bitmap, the reduction of sorted chunks
/// and its finish, and the zero rows (a fill beside the cluster sort, by bitmap word beside
/// the launch sort).
const FWD_KERNEL: &str = "emb_fwd";
const SORT_COUNT: &str = "emb_sort_count";
const SORT_SCATTER: &str = "emb_sort_scatter";
const REDUCE: &str = "emb_bwd_reduce";
const FINISH: &str = "emb_bwd_finish";
const ZERO_ROWS_FILL: &str = "emb_zero_rows";
const CLUSTER_SORT: &str = "emb_sort_cluster";
const MARK_ROWS: &str = "emb_mark_rows";
const ZERO_ROWS_BY_WORD: &str = "emb_zero_rows_by_word";
const BWD_KERNELS: &[&str] = &[
    SORT_COUNT,
    SORT_SCATTER,
    REDUCE,
    FINISH,
    ZERO_ROWS_FILL,
    CLUSTER_SORT,
    MARK_ROWS,
    ZERO_ROWS_BY_WORD,
];
/// The zero rows' CTAs per multiprocessor: they run beside the sort or the reduction, which
/// keep the rest. emb_zero_rows (after the bitmap, beside the cluster sort) measured at 2, 4
/// and 8 at GPT-2's shape: 50.5, 48.6 and 48.8 us; emb_zero_rows_by_word (after the launch
/// sort) at 1, 2, 4 and 8: 4 was best on the D=4096 tables, the same elsewhere.
const ZERO_BLOCKS_PER_SM: u32 = 4;
/// emb_zero_rows_by_word's work items (32 rows x `ZERO_SLICE` column vectors, as in the
/// kernel) one CTA of 8 warps takes per sweep.
const ZERO_ITEMS_PER_BLOCK: i64 = 8;
const ZERO_SLICE: i64 = 128;

/// `embedding` (out: the gathered rows, shape indices + [D]) and `embedding_dense_backward`
/// (out: grad_weight [num_weights, D]).
pub struct Embedding;

impl Family for Embedding {
    type Call = TfEmbeddingCall;

    const FAMILY: OpFamily = OpFamily::Embedding;

    /// The table's (grad's) dtype; forward: indices' shape + [D], backward: grad's shape.
    unsafe fn unreadable(_entry: Entry, call: &TfEmbeddingCall) -> Option<&TfTensor> {
        TfTensor::first_unreadable(&[&call.weight, &call.grad, &call.indices], true)
    }

    unsafe fn describe(entry: Entry, call: &TfEmbeddingCall) -> Option<(&'static str, Vec<i64>)> {
        let indices = call.indices.given()?;
        if entry == Entry::Embedding {
            let weight = call.weight.given()?;
            let mut shape = indices.sizes().to_vec();
            shape.extend(weight.sizes().get(1));
            Some((weight.kind_name(), shape))
        } else {
            Some(describe(call.grad.given()?))
        }
    }

    unsafe fn serve(
        entry: Entry,
        launch: Launch,
        call: &TfEmbeddingCall,
        _shape: &[i64],
    ) -> Result<Served, StockReason> {
        let indices = call.indices.given().ok_or(StockReason::InvalidInput)?;
        let gathered = if entry == Entry::Embedding {
            let weight = call.weight.given().ok_or(StockReason::InvalidInput)?;
            forward(launch, weight, indices)?
        } else {
            let grad = call.grad.given().ok_or(StockReason::InvalidInput)?;
            backward(
                launch,
                &BackwardCall {
                    grad,
                    indices,
                    num_weights: call.num_weights,
                    padding_idx: call.padding_idx,
                    scale_grad_by_freq: call.scale_grad_by_freq != 0,
                },
            )?
        };
        Ok(Served::new(
            gathered.kernel,
            [Some(gathered.output), None, None],
        ))
    }

    fn kernels(op: KernelOp) -> &'static [&'static str] {
        if op == KernelOp::EmbeddingBwd {
            BWD_KERNELS
        } else {
            &[FWD_KERNEL]
        }
    }

    fn kernel_args(kernel: &str) -> Option<&'static [Field]> {
        match kernel {
            FWD_KERNEL => Some(FwdArgs::FIELDS),
            SORT_COUNT => Some(SortCountArgs::FIELDS),
            SORT_SCATTER => Some(SortScatterArgs::FIELDS),
            REDUCE => Some(ReduceArgs::FIELDS),
            FINISH => Some(FinishArgs::FIELDS),
            ZERO_ROWS_FILL | ZERO_ROWS_BY_WORD => Some(ZeroRowsArgs::FIELDS),
            CLUSTER_SORT => Some(SortClusterArgs::FIELDS),
            MARK_ROWS => Some(MarkRowsArgs::FIELDS),
            _ => None,
        }
    }

    fn defines(_op: KernelOp) -> Vec<String> {
        SHARED
            .iter()
            .map(|(name, value)| format!("-DTF_EMB_{name}={value}"))
            .collect()
    }

    type Params = Params;

    fn prepare(v: &Variant) -> Result<Params, String> {
        prepare(v)
    }
}

/// An embedding variant's compile-time params (`registry/embedding.toml`), checked once.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE", deny_unknown_fields)]
pub struct Params {
    /// Forward: threads per CTA of the gather, a multiple of 32.
    #[serde(default = "gather_threads")]
    threads: i64,
    /// Forward: rows' vectors in flight per thread.
    #[serde(default = "gather_unroll")]
    unroll: i64,
    /// Backward: the one-launch sort on a thread-block cluster (sm 90) where it fits.
    #[serde(default, with = "flag")]
    sort_cluster: bool,
}

fn gather_threads() -> i64 {
    256
}

fn gather_unroll() -> i64 {
    4
}

/// An embedding variant's params, and their limits.
fn prepare(v: &Variant) -> Result<Params, String> {
    let p: Params = params::parse(v)?;
    let takes: &[&str] = match v.op {
        KernelOp::EmbeddingBwd => &["SORT_CLUSTER"],
        _ => &["THREADS", "UNROLL"],
    };
    if let Some(other) = v.params.keys().find(|k| !takes.contains(&k.as_str())) {
        return Err(format!(
            "{}: unknown param {other} (this op takes {takes:?})",
            v.name
        ));
    }
    if p.sort_cluster && v.sm[0] < 90 {
        return Err(format!(
            "{}: SORT_CLUSTER needs thread-block clusters (sm >= 90)",
            v.name
        ));
    }
    if !(32..=1024).contains(&p.threads) || p.threads % 32 != 0 {
        return Err(format!(
            "{}: THREADS must be a multiple of 32 in 32..=1024",
            v.name
        ));
    }
    params::in_range(v, "UNROLL", p.unroll, 1..=8)?;
    Ok(p)
}

/// The digits of the backward's radix sort: (passes, bits per pass, bits in all) for a table
/// of `num_weights` rows. Keys are row numbers, so only as many bits as the last row has.
pub fn sort_digits(num_weights: i64) -> (u32, u32, u32) {
    let last = u64::try_from(num_weights.max(1) - 1).unwrap_or(0);
    let bits = (64 - last.leading_zeros()).max(1);
    let passes = bits.div_ceil(MAX_DIGIT_BITS);
    (passes, bits.div_ceil(passes), bits)
}

fn index_kind(indices: &TfTensor) -> Result<bool, StockReason> {
    match indices.kind() {
        Some(Kind::Int64) => Ok(true),
        Some(Kind::Int) => Ok(false),
        // Stock raises its own error for other index types.
        _ => Err(StockReason::InvalidInput),
    }
}

/// Tokens per thread of the cluster sort for `tokens` tokens (1, 2, 4 or 8: each CTA's tile
/// is that many times its threads), or None above its capacity.
pub fn cluster_sort_items(tokens: i64) -> Option<i32> {
    let per_thread = (tokens + CLUSTER_SORT_MAX_TOKENS / CLUSTER_SORT_ITEMS_MAX - 1)
        / (CLUSTER_SORT_MAX_TOKENS / CLUSTER_SORT_ITEMS_MAX);
    [1, 2, 4, 8]
        .into_iter()
        .find(|&items| per_thread <= i64::from(items))
}

struct Gathered {
    pub output: Tensor,
    pub kernel: &'static str,
}

/// `embedding(weight, indices, ...)`: rows of `weight` gathered into a new contiguous tensor
/// of shape `indices.shape + [D]`. padding_idx, scale_grad_by_freq and sparse only concern
/// the backward.
fn forward(launch: Launch, weight: &TfTensor, indices: &TfTensor) -> Result<Gathered, StockReason> {
    let kind = weight.kind().ok_or(StockReason::UnsupportedDtype)?;
    let dtype = dtype_of(kind).ok_or(StockReason::UnsupportedDtype)?;
    let idx64 = index_kind(indices)?;
    let device = gpu::torch_device(launch)?;
    let [num_weights, cols] = *weight.sizes() else {
        return Err(StockReason::InvalidInput);
    };
    if indices.device() != device || weight.device() != device {
        return Err(StockReason::InvalidInput);
    }
    let tokens = indices.numel();
    if tokens == 0 || cols == 0 {
        return Err(StockReason::EmptyInput);
    }
    if num_weights == 0 {
        // Every index is out of range: stock's error.
        return Err(StockReason::InvalidInput);
    }
    let strides = weight.strides();
    if cols > 1 && strides[1] != 1 {
        return Err(StockReason::NoVariantForShape);
    }
    let cols_i32 = i32::try_from(cols).map_err(|_| StockReason::NoVariantForShape)?;
    let row_stride = strides[0];
    let Selected {
        gpu,
        variant,
        kernels,
        params,
    } = super::select(launch, |sm| Request {
        op: KernelOp::EmbeddingFwd,
        dtype,
        hidden: cols,
        rows: tokens,
        sm,
        deterministic: false,
        narrowed: false,
    })?;

    let mut shape = indices.sizes().to_vec();
    shape.push(cols);
    let indices = indices.contiguous()?;
    let output = empty(&shape, kind, device)?;
    let vec = dtype.vector_elems();
    let row_bytes_aligned = (row_stride * dtype.size_bytes() as i64) % 16 == 0;
    let vectorized = i32::from(
        cols % vec == 0 && row_bytes_aligned && aligned16([weight.addr(), device_addr(&output)]),
    );

    let p = Embedding::params(params)?;
    // `prepare` keeps it in 32..=1024.
    let (threads, unroll) = (p.threads as u32, p.unroll);
    let units = tokens * if vectorized == 1 { cols / vec } else { cols };
    let gather = kernels.get(FWD_KERNEL)?;
    let resident = gather.resident_per_sm(threads) * gpu.multiprocessors;
    let grid = gpu::grid_dim(units, i64::from(threads) * unroll)?.clamp(1, resident.max(1));

    let (w_ptr, i_ptr, o_ptr) = (weight.addr(), indices.addr(), device_addr(&output));
    let idx64 = i32::from(idx64);
    let stream = gpu.stream(launch);
    let mut args = stream.launch_builder(&gather.function);
    let fwd_args = FwdArgs {
        weight: w_ptr,
        row_stride,
        indices: i_ptr,
        idx64,
        tokens,
        cols: cols_i32,
        num_weights,
        out: o_ptr,
        vectorized,
    };
    args::push(&mut args, &fwd_args);
    let config = LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: emb_fwd's parameters are FwdArgs's fields (the compile test checks); weight holds num_weights rows of cols
    // elements `row_stride` apart, indices `tokens` values of the given width, output tokens x
    // cols elements; all live until the stream is done with them.
    unsafe { args.launch(config) }.map_err(|e| super::launch_failed(variant, e))?;
    Ok(Gathered {
        output,
        kernel: variant.name.as_str(),
    })
}

struct BackwardCall<'a> {
    pub grad: &'a TfTensor,
    pub indices: &'a TfTensor,
    pub num_weights: i64,
    pub padding_idx: i64,
    pub scale_grad_by_freq: bool,
}

/// `embedding_dense_backward`: grad_weight [num_weights, D] in grad's dtype; row v is the sum
/// of the grad rows of the tokens whose index is v (in token order, fp32), zero for untouched
/// rows and for `padding_idx`. Deterministic.
/// A backward call checked: what stock would reject, or the kernels cannot take, goes to
/// stock.
struct BackwardShape {
    kind: Kind,
    dtype: crate::select::DType,
    idx64: bool,
    device: tch::Device,
    /// The embedding width D and the tokens (indices) of the call.
    cols: i64,
    cols_i32: i32,
    tokens: i64,
}

fn check_backward(launch: Launch, call: &BackwardCall) -> Result<BackwardShape, StockReason> {
    if call.scale_grad_by_freq {
        return Err(StockReason::ScaleGradByFreq);
    }
    let kind = call.grad.kind().ok_or(StockReason::UnsupportedDtype)?;
    let dtype = dtype_of(kind).ok_or(StockReason::UnsupportedDtype)?;
    let idx64 = index_kind(call.indices)?;
    let device = gpu::torch_device(launch)?;
    if call.indices.device() != device || call.grad.device() != device {
        return Err(StockReason::InvalidInput);
    }
    let Some(&cols) = call.grad.sizes().last() else {
        return Err(StockReason::InvalidInput);
    };
    let tokens = call.indices.numel();
    // Stock views grad as [tokens, D]; anything else is its error.
    if Some(call.grad.numel()) != tokens.checked_mul(cols) {
        return Err(StockReason::InvalidInput);
    }
    if tokens == 0 || cols == 0 || call.num_weights <= 0 {
        return Err(StockReason::EmptyInput);
    }
    // Sorted keys and token numbers are 32-bit.
    if tokens > i64::from(i32::MAX) || call.num_weights > i64::from(i32::MAX) {
        return Err(StockReason::NoVariantForShape);
    }
    let cols_i32 = i32::try_from(cols).map_err(|_| StockReason::NoVariantForShape)?;
    Ok(BackwardShape {
        kind,
        dtype,
        idx64,
        device,
        cols,
        cols_i32,
        tokens,
    })
}

/// The backward's one workspace allocation (each allocation through PyTorch costs
/// microseconds of host time, which decides small calls), as byte offsets of its regions
/// (each 16-byte aligned) and its size:
/// 0. partials: two fp32 rows per chunk;
/// 1. two (keys, token numbers) buffers the sort passes alternate between;
/// 2. the sort's digit histograms, one row per tile;
/// 3. one bit per table row (touched by some token), then the work list of rows cut by chunk
///    edges (its two lengths, light and heavy rows, then up to one entry per chunk): zeroed
///    before the sort; `flag_words` 32-bit words;
/// 4. each cut row's first partial.
struct Workspace {
    offsets: [i64; 5],
    total: i64,
    bitmap_words: i64,
    flag_words: i64,
}

impl Workspace {
    fn plan(
        tokens: i64,
        cols: i64,
        num_weights: i64,
        tiles: u32,
        chunks: u32,
        digit_bits: u32,
    ) -> Workspace {
        let bitmap_words = gpu::ceil_div(num_weights, 32);
        let flag_words = bitmap_words + 2 + i64::from(chunks);
        let regions = [
            i64::from(chunks) * 2 * cols * 4,
            4 * tokens * 4,
            (i64::from(tiles) << digit_bits) * 4,
            flag_words * 4,
            num_weights * 4,
        ];
        let mut offsets = [0i64; 5];
        let mut total = 0i64;
        for (offset, bytes) in offsets.iter_mut().zip(regions) {
            *offset = total;
            total += gpu::ceil_div(bytes, 16) * 16;
        }
        Workspace {
            offsets,
            total,
            bitmap_words,
            flag_words,
        }
    }
}

fn backward(launch: Launch, call: &BackwardCall) -> Result<Gathered, StockReason> {
    let BackwardShape {
        kind,
        dtype,
        idx64,
        device,
        cols,
        cols_i32,
        tokens,
    } = check_backward(launch, call)?;
    let Selected {
        gpu,
        variant,
        kernels,
        params,
    } = super::select(launch, |sm| Request {
        op: KernelOp::EmbeddingBwd,
        dtype,
        hidden: cols,
        rows: tokens,
        sm,
        deterministic: false,
        narrowed: false,
    })?;

    let sort_cluster = Embedding::params(params)?.sort_cluster;
    let sort_count = kernels.get(SORT_COUNT)?;
    let sort_scatter = kernels.get(SORT_SCATTER)?;
    let reduce = kernels.get(REDUCE)?;
    let finish = kernels.get(FINISH)?;
    let cluster_sort = kernels.get(CLUSTER_SORT)?;
    let mark_rows = kernels.get(MARK_ROWS)?;
    let zero_rows_kernel = kernels.get(ZERO_ROWS_FILL)?;
    let zero_rows_by_word = kernels.get(ZERO_ROWS_BY_WORD)?;

    let grad = call.grad.contiguous()?;
    let indices = call.indices.contiguous()?;
    let num_weights = call.num_weights;
    let (passes, digit_bits, bits) = sort_digits(num_weights);
    let sort_items = if tokens <= SMALL_TILES_MAX_TOKENS {
        SORT_ITEMS_SMALL
    } else {
        SORT_ITEMS_LARGE
    };
    let tiles = gpu::grid_dim(tokens, i64::from(sort_items) * i64::from(SORT_THREADS))?;
    let chunks = gpu::grid_dim(tokens, CHUNK)?;
    let Workspace {
        offsets,
        total,
        bitmap_words,
        flag_words,
    } = Workspace::plan(tokens, cols, num_weights, tiles, chunks, digit_bits);
    let workspace = empty(&[total], Kind::Uint8, device)?;
    let grad_weight = empty(&[num_weights, cols], kind, device)?;
    let base = device_addr(&workspace);
    let at = |region: usize| base + offsets[region] as u64;
    let (partials_ptr, sort_ptr, hist_ptr, touched_ptr, row_first_ptr) =
        (at(0), at(1), at(2), at(3), at(4));

    let vec = dtype.vector_elems();
    // The workspace is 16-byte aligned (PyTorch's allocator) and so is every region.
    let (grad_ptr, idx_ptr) = (grad.addr(), indices.addr());
    let out_ptr = device_addr(&grad_weight);
    let vectorized = i32::from(cols % vec == 0 && aligned16([grad_ptr, out_ptr, base]));
    let work_ptr = touched_ptr + (bitmap_words * 4) as u64;
    let idx64 = i32::from(idx64);
    let tiles_i32 = tiles as i32;
    let padding_idx = call.padding_idx;

    let stream = gpu.stream(launch);
    let failed = |e| super::launch_failed(variant, e);
    let cluster_items = cluster_sort_items(tokens).filter(|_| {
        sort_cluster
            && gpu.sm >= 90
            && cluster_sort
                .allow_shared_bytes(CLUSTER_SORT_SMEM)
                .and_then(|()| {
                    cluster_sort.resident_clusters(
                        CLUSTER_SORT_CTAS,
                        CLUSTER_SORT_THREADS,
                        CLUSTER_SORT_SMEM,
                        &stream,
                    )
                })
                .is_ok()
    });
    if cluster_items.is_none() {
        // SAFETY: the flags region lies inside the workspace, which lives until the stream is
        // done with it; the memset is ordered on PyTorch's stream before the launches below.
        unsafe {
            cudarc::driver::result::memset_d8_async(
                touched_ptr,
                0,
                (flag_words * 4) as usize,
                stream.cu_stream(),
            )
        }
        .map_err(failed)?;
    }
    let sort_config = LaunchConfig {
        grid_dim: (tiles, 1, 1),
        block_dim: (SORT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let vectors = if vectorized == 1 { cols / vec } else { cols };
    let zero_items = if cluster_items.is_some() {
        // emb_zero_rows: ZERO_UNROLL column vectors a thread per round.
        gpu::grid_dim(num_weights * vectors, i64::from(SORT_THREADS) * ZERO_UNROLL)?
    } else {
        let items = gpu::ceil_div(num_weights, 32) * gpu::ceil_div(vectors, ZERO_SLICE);
        gpu::grid_dim(items, ZERO_ITEMS_PER_BLOCK)?
    };
    let zero_blocks = zero_items.clamp(1, ZERO_BLOCKS_PER_SM * gpu.multiprocessors);
    let launches = BackwardLaunches {
        stream: &stream,
        sort_count,
        sort_scatter,
        reduce,
        finish,
        cluster_sort,
        mark_rows,
        zero_rows: if cluster_items.is_some() {
            zero_rows_kernel
        } else {
            zero_rows_by_word
        },
        cluster_items,
        idx_ptr,
        idx64,
        tokens,
        num_weights,
        cols_i32,
        padding_idx,
        vectorized,
        grad_ptr,
        out_ptr,
        partials_ptr,
        sort_ptr,
        hist_ptr,
        touched_ptr,
        row_first_ptr,
        work_ptr,
        bitmap_words,
        passes,
        digit_bits,
        bits,
        sort_items,
        tiles_i32,
        sort_config,
        zero_config: LaunchConfig {
            grid_dim: (zero_blocks, 1, 1),
            ..sort_config
        },
        // emb_bwd_reduce: one warp per (chunk, slice of 32 column vectors).
        reduce_blocks: gpu::grid_dim(
            i64::from(chunks) * gpu::ceil_div(vectors, 32),
            i64::from(REDUCE_THREADS / 32),
        )?,
        // Persistent: the work list's length is only known on the GPU.
        finish_blocks: (finish.resident_per_sm(FINISH_THREADS) * gpu.multiprocessors).max(1),
    };
    gpu.with_side_stream(|side| {
        let launched = launches.run(side);
        // Always: grad_weight and the workspace may be handed back to PyTorch only after the
        // side stream is done with them, on the error path too.
        launched.and(side.join_into(&stream))
    })
    .and_then(|launched| launched)
    .map_err(failed)?;
    Ok(Gathered {
        output: grad_weight,
        kernel: variant.name.as_str(),
    })
}

// The kernels' arguments (kernels/embedding.cu): device addresses as u64; `idx64` whether
// the indices are int64 (else int32); `n` the tokens.
kernel_args! {
    /// emb_fwd's: `tokens` rows of `cols` gathered from weight's rows `row_stride` apart.
    struct FwdArgs {
        weight: u64,
        row_stride: i64,
        indices: u64,
        idx64: i32,
        tokens: i64,
        cols: i32,
        num_weights: i64,
        out: u64,
        vectorized: i32,
    }
}

kernel_args! {
    /// emb_sort_count's: one radix pass's digit counts (`bits` of the key from `shift`).
    struct SortCountArgs {
        indices: u64,
        idx64: i32,
        keys_in: u64,
        n: i64,
        num_weights: i64,
        shift: i32,
        bits: i32,
        hist: u64,
        touched: u64,
        items: i32,
    }
}

kernel_args! {
    /// emb_sort_scatter's: the pass's stable scatter.
    struct SortScatterArgs {
        indices: u64,
        idx64: i32,
        keys_in: u64,
        pos_in: u64,
        n: i64,
        num_weights: i64,
        shift: i32,
        bits: i32,
        hist: u64,
        tiles: i32,
        keys_out: u64,
        pos_out: u64,
        items: i32,
    }
}

kernel_args! {
    /// emb_sort_cluster's: the whole sort in one cluster.
    struct SortClusterArgs {
        indices: u64,
        idx64: i32,
        n: i64,
        num_weights: i64,
        passes: i32,
        digit_bits: i32,
        bits: i32,
        keys_out: u64,
        pos_out: u64,
        items: i32,
    }
}

kernel_args! {
    /// emb_mark_rows's: the touched rows' bitmap (and the words after it cleared).
    struct MarkRowsArgs {
        indices: u64,
        idx64: i32,
        n: i64,
        num_weights: i64,
        flags: u64,
        flag_words: i64,
    }
}

kernel_args! {
    /// emb_zero_rows's and emb_zero_rows_by_word's: zeros for untouched rows and the padding row.
    struct ZeroRowsArgs {
        touched: u64,
        cols: i32,
        num_weights: i64,
        padding_idx: i64,
        out: u64,
        vectorized: i32,
    }
}

kernel_args! {
    /// emb_bwd_reduce's: the sorted chunks' sums.
    struct ReduceArgs {
        grad: u64,
        keys: u64,
        pos: u64,
        n: i64,
        cols: i32,
        num_weights: i64,
        padding_idx: i64,
        partials: u64,
        out: u64,
        row_first: u64,
        work: u64,
        vectorized: i32,
    }
}

kernel_args! {
    /// emb_bwd_finish's: the rows cut by chunk edges.
    struct FinishArgs {
        keys: u64,
        n: i64,
        cols: i32,
        partials: u64,
        row_first: u64,
        work: u64,
        out: u64,
        vectorized: i32,
    }
}

/// The backward's launches once planned: the kernels, the device addresses of the inputs, the
/// output and the workspace's regions, the sort's digits and the launch shapes.
struct BackwardLaunches<'a> {
    stream: &'a cudarc::driver::CudaStream,
    sort_count: &'a gpu::Kernel,
    sort_scatter: &'a gpu::Kernel,
    reduce: &'a gpu::Kernel,
    finish: &'a gpu::Kernel,
    cluster_sort: &'a gpu::Kernel,
    mark_rows: &'a gpu::Kernel,
    /// emb_zero_rows beside the cluster sort, emb_zero_rows_by_word after the launch sort.
    zero_rows: &'a gpu::Kernel,
    /// The cluster sort's tokens per thread, where it serves the call.
    cluster_items: Option<i32>,
    idx_ptr: u64,
    idx64: i32,
    tokens: i64,
    num_weights: i64,
    cols_i32: i32,
    padding_idx: i64,
    vectorized: i32,
    grad_ptr: u64,
    out_ptr: u64,
    partials_ptr: u64,
    sort_ptr: u64,
    hist_ptr: u64,
    touched_ptr: u64,
    row_first_ptr: u64,
    work_ptr: u64,
    bitmap_words: i64,
    passes: u32,
    digit_bits: u32,
    bits: u32,
    sort_items: i32,
    tiles_i32: i32,
    sort_config: LaunchConfig,
    zero_config: LaunchConfig,
    reduce_blocks: u32,
    finish_blocks: u32,
}

impl BackwardLaunches<'_> {
    /// Sort buffer `b` (keys or token numbers of one pass): `tokens` words.
    fn buffer(&self, b: i64) -> u64 {
        self.sort_ptr + (b * self.tokens * 4) as u64
    }

    /// The sort, the zero rows on the side stream beside it or beside the reduction, the
    /// reduction and its finish. The side stream is forked from the caller's once the bitmap
    /// of touched rows is complete; the caller joins it back.
    fn run(&self, side: &gpu::SideStream) -> Result<(), DriverError> {
        let (keys, pos) = match self.cluster_items {
            Some(items) => self.cluster_sort(side, items)?,
            None => {
                let sorted = self.launch_sort()?;
                // After the launch sort, the zero rows are written beside the reduction.
                // Beside that sort they slow its few latency-bound CTAs down more than they
                // gain (measured: 96 against 77 us at GPT-2's shape), and a one-CTA sort on
                // chip is slower still (63 us for 16k tokens).
                side.fork_from(self.stream)?;
                self.zero_rows(side)?;
                sorted
            }
        };
        self.reduce(keys, pos)
    }

    /// Zeros for every row no token touches, and the padding row, on the side stream.
    fn zero_rows(&self, side: &gpu::SideStream) -> Result<(), DriverError> {
        let mut args = side.stream.launch_builder(&self.zero_rows.function);
        let zero_args = ZeroRowsArgs {
            touched: self.touched_ptr,
            cols: self.cols_i32,
            num_weights: self.num_weights,
            padding_idx: self.padding_idx,
            out: self.out_ptr,
            vectorized: self.vectorized,
        };
        args::push(&mut args, &zero_args);
        // SAFETY: emb_zero_rows's and emb_zero_rows_by_word's parameters are ZeroRowsArgs's
        // fields (the compile test checks); the bitmap holds one bit per row and is complete (the side stream was forked
        // after the first count pass, or after emb_mark_rows), grad_weight holds num_weights
        // x cols elements; the caller's stream joins the side stream before either can be
        // freed.
        unsafe { args.launch(self.zero_config) }.map(|_| ())
    }

    /// The touched rows' bitmap, then the whole sort in one launch of one cluster, with the
    /// zero rows beside it. Returns the sorted (keys, token numbers).
    fn cluster_sort(&self, side: &gpu::SideStream, items: i32) -> Result<(u64, u64), DriverError> {
        // The touched rows first, so that the zero rows run beside the sort: it keeps to one
        // cluster's SMs and to shared memory, so the zero rows' writes hardly slow it. The
        // bitmap and the work list's two lengths are cleared by the same launch.
        let clear_words = self.bitmap_words + 2;
        let mut args = self.stream.launch_builder(&self.mark_rows.function);
        let mark_args = MarkRowsArgs {
            indices: self.idx_ptr,
            idx64: self.idx64,
            n: self.tokens,
            num_weights: self.num_weights,
            flags: self.touched_ptr,
            flag_words: clear_words,
        };
        args::push(&mut args, &mark_args);
        let config = LaunchConfig {
            grid_dim: (CLUSTER_SORT_CTAS, 1, 1),
            block_dim: (MARK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: emb_mark_rows's parameters are MarkRowsArgs's fields (compiled with a cluster of
        // CLUSTER_SORT_CTAS, launched as one, whose threads take MARK_ITEMS tokens each: at
        // least CLUSTER_SORT_MAX_TOKENS); indices holds `tokens` values, the flags region
        // bitmap_words + 2 + chunks words; both live until the stream is done with them.
        unsafe { args.launch(config) }?;
        // The zero rows wait for the bitmap only, but are launched after the sort: queued
        // first, their CTAs took the SMs the sort's cluster needs, and it waited for them.
        side.fork_from(self.stream)?;
        let (keys_out, pos_out) = (self.buffer(0), self.buffer(1));
        let (passes, digit_bits, bits) =
            (self.passes as i32, self.digit_bits as i32, self.bits as i32);
        let mut args = self.stream.launch_builder(&self.cluster_sort.function);
        let sort_args = SortClusterArgs {
            indices: self.idx_ptr,
            idx64: self.idx64,
            n: self.tokens,
            num_weights: self.num_weights,
            passes,
            digit_bits,
            bits,
            keys_out,
            pos_out,
            items,
        };
        args::push(&mut args, &sort_args);
        let config = LaunchConfig {
            grid_dim: (CLUSTER_SORT_CTAS, 1, 1),
            block_dim: (CLUSTER_SORT_THREADS, 1, 1),
            shared_mem_bytes: CLUSTER_SORT_SMEM,
        };
        // SAFETY: emb_sort_cluster's parameters are SortClusterArgs's fields (compiled with a cluster of
        // CLUSTER_SORT_CTAS, launched as one); indices holds `tokens` values, at most the
        // cluster's CTAs x threads x items; keys_out and pos_out `tokens` words each; all live
        // until the stream is done with them.
        unsafe { args.launch(config) }?;
        self.zero_rows(side)?;
        Ok((keys_out, pos_out))
    }

    /// The LSD radix sort as two launches a pass (count, scatter); the first count pass also
    /// sets the touched rows' bits. Returns the sorted (keys, token numbers).
    fn launch_sort(&self) -> Result<(u64, u64), DriverError> {
        let (mut keys_in, mut pos_in) = (0u64, 0u64);
        for pass in 0..self.passes {
            let shift = (pass * self.digit_bits) as i32;
            let pass_bits = self.digit_bits.min(self.bits - pass * self.digit_bits) as i32;
            let target = i64::from(pass % 2) * 2;
            let (keys_out, pos_out) = (self.buffer(target), self.buffer(target + 1));
            let touched = if pass == 0 { self.touched_ptr } else { 0 };
            let mut args = self.stream.launch_builder(&self.sort_count.function);
            let count_args = SortCountArgs {
                indices: self.idx_ptr,
                idx64: self.idx64,
                keys_in,
                n: self.tokens,
                num_weights: self.num_weights,
                shift,
                bits: pass_bits,
                hist: self.hist_ptr,
                touched,
                items: self.sort_items,
            };
            args::push(&mut args, &count_args);
            // SAFETY: emb_sort_count's parameters are SortCountArgs's fields; indices holds `tokens`
            // values, keys_in (null on the first pass) `tokens` keys, hist tiles << digit_bits
            // counters, the bitmap one bit per row (null after the first pass); all live until
            // the stream is done with them.
            unsafe { args.launch(self.sort_config) }?;
            let mut args = self.stream.launch_builder(&self.sort_scatter.function);
            let scatter_args = SortScatterArgs {
                indices: self.idx_ptr,
                idx64: self.idx64,
                keys_in,
                pos_in,
                n: self.tokens,
                num_weights: self.num_weights,
                shift,
                bits: pass_bits,
                hist: self.hist_ptr,
                tiles: self.tiles_i32,
                keys_out,
                pos_out,
                items: self.sort_items,
            };
            args::push(&mut args, &scatter_args);
            // SAFETY: as above for emb_sort_scatter (SortScatterArgs); keys_out and pos_out hold `tokens` values
            // each and differ from keys_in and pos_in.
            unsafe { args.launch(self.sort_config) }?;
            (keys_in, pos_in) = (keys_out, pos_out);
        }
        Ok((keys_in, pos_in))
    }

    /// The sorted chunks' sums into grad_weight, then the rows cut by chunk edges.
    fn reduce(&self, keys: u64, pos: u64) -> Result<(), DriverError> {
        let mut args = self.stream.launch_builder(&self.reduce.function);
        let reduce_args = ReduceArgs {
            grad: self.grad_ptr,
            keys,
            pos,
            n: self.tokens,
            cols: self.cols_i32,
            num_weights: self.num_weights,
            padding_idx: self.padding_idx,
            partials: self.partials_ptr,
            out: self.out_ptr,
            row_first: self.row_first_ptr,
            work: self.work_ptr,
            vectorized: self.vectorized,
        };
        args::push(&mut args, &reduce_args);
        let config = LaunchConfig {
            grid_dim: (self.reduce_blocks, 1, 1),
            block_dim: (REDUCE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: emb_bwd_reduce's parameters are ReduceArgs's fields; grad holds tokens x cols
        // elements, keys/pos the sorted `tokens` pairs, partials chunks x 2 x cols fp32 values,
        // grad_weight num_weights x cols elements, row_first num_weights words, the work list
        // 2 + chunks words.
        unsafe { args.launch(config) }?;
        let mut args = self.stream.launch_builder(&self.finish.function);
        let finish_args = FinishArgs {
            keys,
            n: self.tokens,
            cols: self.cols_i32,
            partials: self.partials_ptr,
            row_first: self.row_first_ptr,
            work: self.work_ptr,
            out: self.out_ptr,
            vectorized: self.vectorized,
        };
        args::push(&mut args, &finish_args);
        let config = LaunchConfig {
            grid_dim: (self.finish_blocks, 1, 1),
            block_dim: (FINISH_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: as above for emb_bwd_finish (FinishArgs).
        unsafe { args.launch(config) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn workspace_regions_are_aligned_disjoint_and_hold_their_bytes() {
        for (tokens, cols, rows) in [(1, 1, 1), (16384, 768, 50304), (3, 1100, 70000)] {
            let chunks = gpu::grid_dim(tokens, CHUNK).unwrap();
            let tiles = gpu::grid_dim(tokens, 4 * i64::from(SORT_THREADS)).unwrap();
            let (_, digit_bits, _) = sort_digits(rows);
            let w = Workspace::plan(tokens, cols, rows, tiles, chunks, digit_bits);
            let needs = [
                i64::from(chunks) * 2 * cols * 4,
                4 * tokens * 4,
                (i64::from(tiles) << digit_bits) * 4,
                w.flag_words * 4,
                rows * 4,
            ];
            let ends = [
                w.offsets[1],
                w.offsets[2],
                w.offsets[3],
                w.offsets[4],
                w.total,
            ];
            for (i, ((start, end), need)) in w.offsets.iter().zip(ends).zip(needs).enumerate() {
                assert_eq!(start % 16, 0);
                assert!(end - start >= need, "region {i} of {tokens}x{cols}");
            }
            assert_eq!(w.bitmap_words, (rows + 31) / 32);
        }
    }

    #[test]
    fn cluster_sort_tiles_hold_every_token_and_no_more_than_it_can() {
        // (tokens, tokens per thread)
        let cases = [
            (1, Some(1)),
            (4096, Some(1)),
            (4097, Some(2)),
            (8192, Some(2)),
            (8193, Some(4)),
            (16384, Some(4)),
            (16385, Some(8)),
            (32768, Some(8)),
            (32769, None),
        ];
        for (tokens, items) in cases {
            assert_eq!(cluster_sort_items(tokens), items, "{tokens} tokens");
            if let Some(items) = items {
                let held = i64::from(CLUSTER_SORT_CTAS)
                    * i64::from(CLUSTER_SORT_THREADS)
                    * i64::from(items);
                assert!(held >= tokens && i64::from(items) <= CLUSTER_SORT_ITEMS_MAX);
            }
        }
        assert_eq!(CLUSTER_SORT_MAX_TOKENS, 32768);
        // The kernel's CSORT_SMEM_BYTES for 8 CTAs of 512 threads x 8 tokens, 9-bit digits.
        assert_eq!(CLUSTER_SORT_SMEM, 133_208);
    }

    fn parse_backward(sm: &str, params: &str) -> Result<(), String> {
        crate::ops::parse(&[(
            "t.toml",
            &format!(
                "[[variant]]\nname = \"t\"\nop = \"embedding_bwd\"\nsource = \"embedding.cu\"\n\
                 dtypes = [\"bf16\"]\nsm = {sm}\nparams = {{ {params} }}\n"
            ),
        )])
        .map(|_| ())
    }

    #[test]
    fn the_backward_takes_only_the_cluster_sort_switch_and_only_on_hopper() {
        assert_eq!(parse_backward("[90, 90]", "SORT_CLUSTER = 1"), Ok(()));
        assert_eq!(parse_backward("[80, 90]", "SORT_CLUSTER = 0"), Ok(()));
        let ampere = parse_backward("[80, 90]", "SORT_CLUSTER = 1");
        assert!(ampere.unwrap_err().contains("sm >= 90"));
        let two = parse_backward("[90, 90]", "SORT_CLUSTER = 2");
        assert!(two.unwrap_err().contains("0 or 1"));
        let threads = parse_backward("[90, 90]", "THREADS = 256");
        assert!(threads.unwrap_err().contains("unknown param THREADS"));
    }

    #[test]
    fn sort_digits_cover_every_row_number_in_few_passes() {
        // (rows, passes, bits per pass, bits)
        let cases = [
            (1, 1, 1, 1),
            (2, 1, 1, 1),
            (512, 1, 9, 9),
            (513, 2, 5, 10),
            (32000, 2, 8, 15),
            (50304, 2, 8, 16),
            (128256, 2, 9, 17),
            (1 << 18, 2, 9, 18),
            ((1 << 18) + 1, 3, 7, 19),
            (i64::from(i32::MAX), 4, 8, 31),
        ];
        for (rows, passes, digit, bits) in cases {
            assert_eq!(sort_digits(rows), (passes, digit, bits), "{rows} rows");
            // Every row number fits the passes' digits, and no digit is wider than the
            // kernel's histograms.
            assert!(passes * digit >= bits && digit <= MAX_DIGIT_BITS);
            assert!((rows - 1) >> bits == 0);
        }
    }
}
