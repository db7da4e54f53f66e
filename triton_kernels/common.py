"""Helpers shared by the Triton kernels: directed float16/float32 rounding, rounding to nearest even,
exp/log with documented accuracy, the split-K plan and program indexing, and the launch helpers.

Every kernel runs compiled on a CUDA device, or in Triton's interpreter on CPU tensors (the test-suite
does this at tiny shapes; importing ``certvllm.triton_kernels`` turns the interpreter on where CUDA is
absent). ``libdevice`` has no interpreter implementation, so each kernel takes a ``PRECISE`` constexpr:
True when compiled (libdevice ``expf``/``rint``, ≤ 2 ulp and exact), False under the interpreter (NumPy's
``exp``/``rint``, which are at least as accurate).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .tuning import DEFAULT_TUNING, KernelTuning

__all__ = [
    "GLUE_MAX_BLOCKS",
    "GluonGate",
    "as_mask",
    "copy_page",
    "device_arg",
    "expm1_f32",
    "head_program",
    "log_f32",
    "max_nan",
    "tail_mass_upper",
    "tanh_f32",
    "interpreting",
    "key_scale_sigma",
    "load_key_terms",
    "launch_device_ok",
    "next_pow2",
    "page_base",
    "precise",
    "split_columns",
    "split_plan",
    "split_program",
    "store_split_sums",
]


GLUE_MAX_BLOCKS = 8192
"""Most block-table columns the glue kernels take (128K tokens: the widest table at which the GPU tests run
the windowed selection and its full-order fallback); wider tables use the torch glue."""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter: Triton's own ``knobs.runtime.interpret`` (the
    setting its ``jit`` decorator follows), or, on a Triton without knobs, whether this module's kernels
    were defined as interpreted functions."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is not None and hasattr(runtime, "interpret"):
        return bool(runtime.interpret)
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(as_mask, InterpretedFunction)


def precise() -> bool:
    """The value of every kernel's ``PRECISE`` constexpr."""
    return not interpreting()


def launch_device_ok(t: torch.Tensor) -> None:
    """Refuse CPU tensors outside the interpreter with a clear message (Triton would fail obscurely)."""
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            "certvllm Triton kernels need CUDA tensors, or Triton's interpreter (TRITON_INTERPRET=1 before "
            f"certvllm.triton_kernels is imported) to run on {t.device}"
        )


class _HostPointer:
    """A pinned host tensor handed to a compiled kernel as a plain pointer (``data_ptr`` + ``dtype``, the
    protocol Triton's launcher accepts); the launcher resolves its device address with
    ``cuPointerGetAttribute``, which is valid for registered memory under unified addressing."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor
        self.dtype = tensor.dtype

    def data_ptr(self) -> int:
        return self._tensor.data_ptr()


def device_arg(t: torch.Tensor) -> torch.Tensor | _HostPointer:
    """What to pass a kernel for ``t``: the tensor itself, or a host pointer for host memory when compiled."""
    if t.device.type == "cpu" and not interpreting():
        return _HostPointer(t)
    return t


class GluonGate:
    """Whether one Gluon kernel may still be used in this process, and the fallback when it cannot be built.

    Gluon is an experimental Triton dialect whose API changes between releases: a Triton that imports it
    may still fail to compile a kernel written for another version. :meth:`run` tries the Gluon launch;
    if it raises before this kernel ever launched in this process (a compile failure — the only thing that
    happens at a first launch and not later), it warns once, disables the Gluon kernel for the process and
    runs the Triton kernel, which computes the same certified quantities. An error after a successful
    launch is re-raised: only compilation is forgiven. ``tests/triton_kernels/test_gluon_compile.py`` compiles the Gluon
    kernels for sm_90 in ``make test``, so a failure here means a Triton other than the tested ones.
    ``KernelTuning(dialect="triton")`` skips the Gluon kernels altogether."""

    def __init__(self, name: str, dialect: str = "Gluon") -> None:
        self.name, self.dialect = name, dialect
        self.launched = False
        self.failure: str | None = None

    def run(self, launch_gluon, launch_triton) -> None:
        if self.failure is None:
            try:
                launch_gluon()
            except Exception as err:  # noqa: BLE001 - a compile failure of an experimental dialect
                if self.launched:
                    raise
                self.failure = f"{type(err).__name__}: {str(err)[:400]}"
                import warnings

                built_by = (
                    f"Triton {triton.__version__}" if self.dialect == "Gluon" else "nvcc (torch's extension build)"
                )
                warnings.warn(
                    f"certvllm: the {self.dialect} {self.name} kernel failed to compile with {built_by} "
                    f"({self.failure}); using the Triton kernel for the rest of this process (same results, "
                    'slower). Pass KernelTuning(dialect="triton") to the launchers to skip the attempt.',
                    RuntimeWarning,
                    stacklevel=3,
                )
            else:
                self.launched = True
                return
        launch_triton()


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.cache
def _multiprocessors(index: int) -> int:
    """Multiprocessors of CUDA device ``index`` (asked once per device: a layer call plans two splits)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessors() -> int:
    """Multiprocessors of the current CUDA device; 132 (an H100/H200) under the interpreter or without CUDA, so
    that launch plans made there are the GPU's."""
    return _multiprocessors(torch.cuda.current_device()) if torch.cuda.is_available() and not interpreting() else 132


def split_plan(
    num_blocks: int,
    groups: int,
    blocks_per_split: int | None = None,
    tuning: KernelTuning = DEFAULT_TUNING,
    phase2: bool = False,
) -> tuple[int, int]:
    """Split-K plan ``(splits, blocks_per_split)`` for ``groups`` (row, KV head) programs over
    ``num_blocks`` blocks: at most ``tuning.programs_per_sm`` programs per multiprocessor (``phase2``: the
    promotion and attend passes', ``tuning.phase2_programs_per_sm`` where set; rounded down, so that the
    programs fill whole waves of resident blocks), at least 4 blocks per program."""
    if blocks_per_split is None:
        sms = multiprocessors()
        per_sm = (tuning.phase2_programs_per_sm if phase2 else 0) or tuning.programs_per_sm
        want = max(1, per_sm * sms // max(1, groups))  # rounded down: no partial last wave of programs
        blocks_per_split = max(4, -(-num_blocks // want))
    blocks_per_split = max(1, min(int(blocks_per_split), max(1, num_blocks)))
    return max(1, -(-num_blocks // blocks_per_split)), blocks_per_split


# The split-K kernels (phase 1, the promotion and the attend pass: grid (rows·H_kv, splits)) share these
# arguments, in this order: num_blocks (16-token blocks in the cache; block ids are clamped to it, as the
# reference does), B (block-table columns), TB_STRIDE (row stride of ``tables``), S (splits), BPS (blocks
# per split), and the constexprs H (KV heads), G (query heads per KV head), GP (next power of two ≥ G),
# D (head dim), DP (next power of two ≥ D), M (16-token blocks per engine block).


@triton.jit
def split_program(H: tl.constexpr):
    """``(rk, split, r, h)`` of a split-K program, grid ``(rows·H, splits)``: rk = r·H + h (int64), the
    split, the row r (int64) and the KV head h."""
    rk = tl.program_id(0).to(tl.int64)
    return rk, tl.program_id(1), rk // H, rk % H


@triton.jit
def split_columns(it, jv, split, BPS, B, nf, BLK: tl.constexpr):
    """Block columns ``bv = split·BPS + it·BLK + jv`` of loop iteration ``it`` (``jv``: the ``BLK`` offsets
    in any shape), in the table and the split (``inb``) and full (``valid``: below ``nf``)."""
    iv = it * BLK + jv
    bv = split * BPS + iv
    inb = (bv < B) & (iv < BPS)
    return bv, inb, inb & (bv < nf)


@triton.jit
def page_base(tables, r, TB_STRIDE, bv, mask, num_blocks, h, H: tl.constexpr, M: tl.constexpr,
              PAGE_BYTES: tl.constexpr):  # fmt: skip
    """Block ids of row r's columns ``bv`` (loaded where ``mask``, else 0; clamped to ``[0, num_blocks)`` as
    the reference does) and the byte offsets of their KV-head-h pages in ``cache.pages``."""
    bid = tl.load(tables + r * TB_STRIDE + bv, mask=mask, other=0)
    bid = tl.minimum(tl.maximum(bid, 0), num_blocks - 1)
    return bid, ((bid // M) * H + h) * (M * PAGE_BYTES) + (bid % M) * PAGE_BYTES


@triton.jit
def fp16_round_down(x):
    """Largest float16 ≤ x (x float32) — ``formats.rounding.fp16_round_down``."""
    y = x.to(tl.float16)
    bits = y.to(tl.int16, bitcast=True).to(tl.int32)
    down = tl.where(y > 0, bits - 1, tl.where(y == 0, -32767, bits + 1))  # -32767 = 0x8001: −smallest subnormal
    too_big = y.to(tl.float32) > x
    return tl.where(too_big, down.to(tl.int16).to(tl.float16, bitcast=True), y)


@triton.jit
def fp16_round_up(x):
    """Smallest float16 ≥ x (x float64) — ``formats.rounding.fp16_round_up``. Rounding to float32 first and
    then to float16 lands on one of the two float16 neighbours of x (float16 ⊂ float32, rounding is
    monotone), and the correction picks the upper one."""
    y = x.to(tl.float32).to(tl.float16)
    bits = y.to(tl.int16, bitcast=True).to(tl.int32)
    up = tl.where(y > 0, bits + 1, tl.where(y == 0, 1, bits - 1))
    too_small = y.to(tl.float64) < x
    return tl.where(too_small, up.to(tl.int16).to(tl.float16, bitcast=True), y)


@triton.jit
def fp32_round_up_nonneg(x):
    """Smallest float32 ≥ x for x ≥ 0 (float64) — ``formats.rounding.fp32_round_up``."""
    y = x.to(tl.float32)
    bits = y.to(tl.int32, bitcast=True)
    too_small = y.to(tl.float64) < x
    return tl.where(too_small, (bits + 1).to(tl.float32, bitcast=True), y)


@triton.jit
def rint(x, PRECISE: tl.constexpr):
    """Round to nearest, ties to even (``torch.round``), for |x| < 2^22 (without libdevice: the magic number
    1.5·2^23, whose float32 spacing is 1 on both sides of it; 2^23 would round negative x to halves)."""
    return libdevice.rint(x) if PRECISE else (x + 12582912.0) - 12582912.0


@triton.jit
def exp_f32(x, PRECISE: tl.constexpr):
    """exp in float32 within 2 ulp (libdevice ``expf``; ``tl.exp`` is ``ex2.approx`` of a rounded product,
    whose error grows with |x| and is not what the certificate's exp term assumes)."""
    return libdevice.exp(x) if PRECISE else tl.exp(x)


@triton.jit
def head_program(G: tl.constexpr, H: tl.constexpr):
    """``(pid, rk, g, r)`` of a kernel with one program per (row r, KV head h, query head g of its group):
    pid = (r·H + h)·G + g (int64), rk = r·H + h (int64), g (int32), r (int64)."""
    pid = tl.program_id(0).to(tl.int64)
    rk = pid // G
    return pid, rk, (pid % G).to(tl.int32), rk // H


@triton.jit
def log_f32(x, PRECISE: tl.constexpr):
    """log in float32 (libdevice ``logf``, ≤ 1 ulp; NumPy's under the interpreter)."""
    return libdevice.log(x) if PRECISE else tl.log(x)


@triton.jit
def expm1_f32(x, PRECISE: tl.constexpr):
    """e^x − 1 in float32 (libdevice ``expm1f``; under the interpreter through float64)."""
    return libdevice.expm1(x) if PRECISE else (tl.exp(x.to(tl.float64)) - 1.0).to(tl.float32)


@triton.jit
def tanh_f32(x, PRECISE: tl.constexpr):
    """tanh in float32 (libdevice ``tanhf``; under the interpreter through float64)."""
    return libdevice.tanh(x) if PRECISE else _tanh_f64(x)


@triton.jit
def _tanh_f64(x):
    """tanh of float32 x through float64 exp, rounded to float32 (the interpreter's ``tanh_f32``)."""
    e = tl.exp(2.0 * x.to(tl.float64))
    return tl.where(x > 20.0, 1.0, (e - 1.0) / (e + 1.0)).to(tl.float32)


@triton.jit
def max_nan(a, b):
    """max that keeps a NaN operand (torch's ``amax``/``maximum``), as a reduction combiner too."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def tail_mass_upper(alpha, delta, rounding, GS, PRECISE: tl.constexpr):
    """``bounds.tail_mass_upper``: exp(min(2(Δ + R) + log(α·slack), 0)), float32."""
    return exp_f32(tl.minimum(2.0 * (delta + rounding) + log_f32(alpha * GS, PRECISE), 0.0), PRECISE)


@triton.jit
def pow2_f32(e):
    """2^e as float32 for int32 e in [-126, 127], exactly (from the exponent bits)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def key_scale_sigma(code, ex):
    """σ = LUT[code]·2^E as float32 (``formats.layout.key_scale_lut``), bit for bit, without a table gather.

    LUT[c] = fl32(2^((c − 255)/32)) = 2^(−(c′ >> 5))·T[c′ & 31] with c′ = 255 − c and T[j] = LUT[255 − j]
    (scaling by a power of two commutes with rounding; ``tests/triton_kernels/test_triton_kernels.py`` checks all 256
    codes). T is selected by the five bits of j (a tree of 31 selects of constants), so the kernels need no
    gather, whose layout Triton would impose on the surrounding arithmetic. ``code`` int32 in [0, 255],
    ``ex`` int32 (clamped to [-126, 127] here, as the readers do); the two products are those of
    ``LUT[code] * 2^E``."""
    cp = 255 - code
    j = cp & 31
    b0 = (j & 1) != 0
    b1 = (j & 2) != 0
    b2 = (j & 4) != 0
    b3 = (j & 8) != 0
    b4 = (j & 16) != 0
    t0 = tl.where(b0, 0.9785720705986023, 1.0)
    t1 = tl.where(b0, 0.9370838403701782, 0.9576032757759094)
    t2 = tl.where(b0, 0.8973545432090759, 0.9170040488243103)
    t3 = tl.where(b0, 0.8593096733093262, 0.8781260848045349)
    t4 = tl.where(b0, 0.8228777647018433, 0.8408964276313782)
    t5 = tl.where(b0, 0.7879904508590698, 0.8052451610565186)
    t6 = tl.where(b0, 0.7545822262763977, 0.7711054086685181)
    t7 = tl.where(b0, 0.7225903868675232, 0.7384130954742432)
    t8 = tl.where(b0, 0.6919549703598022, 0.7071067690849304)
    t9 = tl.where(b0, 0.6626183390617371, 0.6771277785301208)
    t10 = tl.where(b0, 0.6345254778862, 0.6484197974205017)
    t11 = tl.where(b0, 0.6076236963272095, 0.6209288835525513)
    t12 = tl.where(b0, 0.5818624496459961, 0.5946035385131836)
    t13 = tl.where(b0, 0.557193398475647, 0.5693942904472351)
    t14 = tl.where(b0, 0.5335702300071716, 0.5452538728713989)
    t15 = tl.where(b0, 0.5109485983848572, 0.5221368670463562)
    u1_0 = tl.where(b1, t1, t0)
    u1_1 = tl.where(b1, t3, t2)
    u1_2 = tl.where(b1, t5, t4)
    u1_3 = tl.where(b1, t7, t6)
    u1_4 = tl.where(b1, t9, t8)
    u1_5 = tl.where(b1, t11, t10)
    u1_6 = tl.where(b1, t13, t12)
    u1_7 = tl.where(b1, t15, t14)
    u2_0 = tl.where(b2, u1_1, u1_0)
    u2_1 = tl.where(b2, u1_3, u1_2)
    u2_2 = tl.where(b2, u1_5, u1_4)
    u2_3 = tl.where(b2, u1_7, u1_6)
    u3_0 = tl.where(b3, u2_1, u2_0)
    u3_1 = tl.where(b3, u2_3, u2_2)
    u4_0 = tl.where(b4, u3_1, u3_0)
    mant = u4_0
    lut = tl.where(code == 0, 0.0, mant * pow2_f32(-(cp >> 5)))  # = LUT[code], exactly
    return lut * pow2_f32(tl.minimum(tl.maximum(ex, -126), 127))


@triton.jit
def pow2_f64(e):
    """2^e as float64 for int32 e in [-1022, 1023], exactly."""
    return ((e.to(tl.int64) + 1023) << 52).to(tl.float64, bitcast=True)


@triton.jit
def ceil_log2_f64(x):
    """⌈log₂ x⌉ (int32) for a normal float64 x > 0, exactly, from its bits."""
    bits = x.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 2047).to(tl.int32) - 1023
    mant = bits & 4503599627370495  # 2^52 − 1
    return tl.where(mant != 0, e + 1, e)


@triton.jit
def as_mask(x):
    """A boolean mask from ``scalar & tensor`` (Triton's interpreter turns such a mix into integers)."""
    return x != 0


@triton.jit
def load_shadow_tile(src, bid, h, kv, H: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                     CHANNEL_MAJOR: tl.constexpr):  # fmt: skip
    """The ``[16, DP]`` tile of one shadow page: 16-token block ``bid``, KV head ``h``, ``kv`` (0 keys,
    1 values) of ``src`` ``[E, H, 2, M·16, D]``; keys are ``[D, M·16]`` per (engine block, head) when
    ``CHANNEL_MAJOR``. Channels ≥ D read as 0."""
    N: tl.constexpr = 16
    sub = bid % M
    base = (((bid // M) * H + h) * 2 + kv) * (M * N * D)
    t = tl.arange(0, N)
    d = tl.arange(0, DP)
    token_major = (sub * N + t[:, None]) * D + d[None, :]
    if CHANNEL_MAJOR:
        offs = tl.where(kv == 0, d[None, :] * (M * N) + sub * N + t[:, None], token_major)
    else:
        offs = token_major
    return tl.load(src + base + offs, mask=d[None, :] < D, other=0.0)


@triton.jit
def holds_copy(tag, tag_gen, slot, page, gen, mask):
    """Whether pool slot ``slot`` holds page ``page``'s copy of write generation ``gen`` (the tag rule every pool
    reader applies, docs/certification.md §5.1); False where ``mask`` is, without loading there."""
    held = mask & (tl.load(tag + slot, mask=mask, other=-1) == page)
    return held & (tl.load(tag_gen + slot, mask=mask, other=-1) == gen)


@triton.jit
def copy_page(src, e, kv, dst, slot, H: tl.constexpr, M: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
              CHANNEL_MAJOR: tl.constexpr):  # fmt: skip
    """Copy the keys (``kv`` = 0) or values (1) of shadow page ``e = block·H + head`` of ``src``
    (:func:`load_shadow_tile`) to slot ``slot`` of ``dst`` ``[P, 16, D]`` (token-major)."""
    x = load_shadow_tile(src, e // H, e % H, kv, H, M, D, DP, CHANNEL_MAJOR)
    store_page_tile(dst + slot * (16 * D), x, D, DP)


@triton.jit
def store_page_tile(dst, x, D: tl.constexpr, DP: tl.constexpr):
    """Store a ``[16, DP]`` tile token-major as the ``[16, D]`` page at ``dst`` (channels ≥ D dropped)."""
    t = tl.arange(0, 16)
    d = tl.arange(0, DP)
    tl.store(dst + t[:, None] * D + d[None, :], x, mask=d[None, :] < D)


@triton.jit
def load_key_terms(pages_u8, pages_i8, pages_f16, pages_f32, base, valid, vm, dv, HEADER: tl.constexpr,
                   K_OFFSET: tl.constexpr, K_SCODE: tl.constexpr):  # fmt: skip
    """A page's header and key metadata (pages at byte offsets ``base``, loaded where ``valid`` / ``vm``):
    ``(η, ν, flags, E, ℓ̃ float32, σ)``, σ = LUT[code]·2^E (:func:`key_scale_sigma`)."""
    e_b = tl.load(pages_f32 + (base + HEADER) // 4, mask=valid, other=0.0)
    n_b = tl.load(pages_f32 + (base + HEADER) // 4 + 1, mask=valid, other=0.0)
    flags = tl.load(pages_u8 + base + HEADER + 9, mask=valid, other=1).to(tl.int32)
    ex = tl.load(pages_i8 + base + HEADER + 8, mask=valid, other=0).to(tl.int32)
    off = tl.load(pages_f16 + (base + K_OFFSET) // 2 + dv, mask=vm, other=0.0).to(tl.float32)
    sc = tl.load(pages_u8 + base + K_SCODE + dv, mask=vm, other=0).to(tl.int32)
    return e_b, n_b, flags, ex, off, key_scale_sigma(sc, ex)


@triton.jit
def store_split_sums(acc, den, aval, atail, rk, split, S, acc_e, acc_o, den64, av64, at64, G: tl.constexpr,
                     GP: tl.constexpr, D: tl.constexpr, DH: tl.constexpr):  # fmt: skip
    """Store one split-K program's float64 partial sums (``[BLK, GP, DH]`` even/odd channels and ``[BLK, GP, 1]``
    masses, reduced over BLK here) into the attend pass's ``[R, H, S, G, ·]`` outputs."""
    gq = tl.arange(0, GP)[:, None]
    orow = (rk * S + split) * G + gq  # [GP, 1]
    om = gq < G
    kq = tl.arange(0, DH)[None, :]
    tl.store(acc + orow * D + 2 * kq, tl.sum(acc_e, axis=0), mask=om & (kq < D // 2))
    tl.store(acc + orow * D + 2 * kq + 1, tl.sum(acc_o, axis=0), mask=om & (kq < D // 2))
    tl.store(den + orow, tl.sum(den64, axis=0), mask=om)
    tl.store(aval + orow, tl.sum(av64, axis=0), mask=om)
    tl.store(atail + orow, tl.sum(at64, axis=0), mask=om)
