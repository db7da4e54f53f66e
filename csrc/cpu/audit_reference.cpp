// Audit mode's exact reference on the CPU (certvllm/attention/audit.py::reference_heads): exact attention of
// single (row, query head) pairs over their gathered shadow pages, evaluated in float64.
//
// Two entries: the pairs' pages read in place from the shadow (the host page-in engine's gather would only copy
// the same bytes: the compiled decode kernel reads the shadow in place too), or gathered by the caller through
// another page-in engine. Only the block-table columns that hold the row's tokens are read, and each element is
// converted to float64 as it is read (no float64 copy of the context). Per pair:
//   s_t = scale · Σ_c q_c k_tc, m = max_t s_t, out = Σ_t e^{s_t − m} v_t / Σ_t e^{s_t − m}    (t < len)
//   v_max = max_t ‖v_t‖₂,  s_max = |scale| · max_t Σ_c |q_c||k_tc|
// every sum in float64 (relative rounding ≲ (len + D)·2⁻⁵³, far inside the audit's 2⁻³⁰·V_max allowance).
// Non-finite inputs propagate as in torch's float64 SDPA: any NaN/inf score or value in the context makes the
// output non-finite (a violation); an empty context gives NaN, as the all-masked SDPA does.
//
// Pairs run in the calling thread unless there are many (at::parallel_for's grain): a sampled audit at the
// default rate is one or two pairs, and a parallel region right after the decode kernel's would only wait for
// the pool's threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kPairsPerTask = 8;  // parallel only from this many pairs on (rate-1 audits of a whole call)
constexpr int kLanes = 8;             // partial sums per dot product over the D channels

// max that propagates NaN from either argument (torch.amax does)
inline double nan_max(double a, double b) { return (a > b || std::isnan(a)) ? a : b; }

template <typename T>
inline double to_d(T x) { return static_cast<double>(static_cast<float>(x)); }

// One 16-token page of a pair: key element (t, c) at k[t * k_tok + c * k_ch], value element at v[t * D + c].
template <typename scalar_t>
struct PageRef {
  const scalar_t* k;
  const scalar_t* v;
  int64_t k_tok, k_ch;
};

// The float64 reference of one pair over ``len`` tokens of ``page(j)`` (j = t / N).
template <typename scalar_t, typename Pages>
void pair(const Pages& page, int64_t len, int64_t N, int64_t D, const double* q, double scale, double* out,
          double* v_max, double* s_max, std::vector<double>& s) {
  s.assign(len, 0.0);
  double m = -std::numeric_limits<double>::infinity(), vm = 0.0, sm = 0.0;
  for (int64_t t = 0; t < len; ++t) {
    const PageRef<scalar_t> p = page(t / N);
    const scalar_t* k = p.k + (t % N) * p.k_tok;
    const scalar_t* v = p.v + (t % N) * D;
    // kLanes independent partial sums per quantity (vectorisable; float64 either way), added up at the end
    double dot_l[kLanes] = {}, mag_l[kLanes] = {}, vv_l[kLanes] = {};
    int64_t c = 0;
    for (; c + kLanes <= D; c += kLanes) {
      for (int l = 0; l < kLanes; ++l) {
        const double kc = to_d(k[(c + l) * p.k_ch]), vc = to_d(v[c + l]);
        dot_l[l] += q[c + l] * kc;
        mag_l[l] += std::fabs(q[c + l]) * std::fabs(kc);
        vv_l[l] += vc * vc;
      }
    }
    for (; c < D; ++c) {
      const double kc = to_d(k[c * p.k_ch]), vc = to_d(v[c]);
      dot_l[0] += q[c] * kc;
      mag_l[0] += std::fabs(q[c]) * std::fabs(kc);
      vv_l[0] += vc * vc;
    }
    double dot = 0.0, mag = 0.0, vv = 0.0;
    for (int l = 0; l < kLanes; ++l) {
      dot += dot_l[l];
      mag += mag_l[l];
      vv += vv_l[l];
    }
    s[t] = dot * scale;
    m = nan_max(m, s[t]);
    sm = nan_max(sm, mag);
    vm = nan_max(vm, std::sqrt(vv));
  }
  for (int64_t c = 0; c < D; ++c) out[c] = 0.0;
  double z = 0.0;
  for (int64_t t = 0; t < len; ++t) {
    const double w = std::exp(s[t] - m);
    const scalar_t* v = page(t / N).v + (t % N) * D;
    z += w;
    for (int64_t c = 0; c < D; ++c) out[c] += w * to_d(v[c]);
  }
  for (int64_t c = 0; c < D; ++c) out[c] /= z;  // len 0: 0/0 = NaN, as the all-masked SDPA
  *v_max = vm;
  *s_max = sm * std::fabs(scale);
}

struct Outputs {
  torch::Tensor out, v_max, s_max;
  explicit Outputs(int64_t n, int64_t D) {
    auto opts = torch::TensorOptions().dtype(torch::kDouble);
    out = torch::empty({n, D}, opts);
    v_max = torch::empty({n}, opts);
    s_max = torch::empty({n}, opts);
  }
  std::vector<torch::Tensor> list() const { return {out, v_max, s_max}; }
};

// pairs over gathered pages: kv [P, 2, N, D], pair i's pages consecutive from first[i]
template <typename scalar_t>
void run_gathered(const torch::Tensor& kv, const int64_t* first, const int64_t* lens, const torch::Tensor& q,
                  double scale, Outputs& res) {
  const int64_t n = q.size(0), D = q.size(1), N = kv.size(2);
  const scalar_t* base = kv.data_ptr<scalar_t>();
  const double* qp = q.data_ptr<double>();
  double *o = res.out.data_ptr<double>(), *vm = res.v_max.data_ptr<double>(), *sm = res.s_max.data_ptr<double>();
  at::parallel_for(0, n, kPairsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<double> s;
    for (int64_t i = begin; i < end; ++i) {
      const scalar_t* pages = base + first[i] * 2 * N * D;
      auto page = [&](int64_t j) {
        const scalar_t* k = pages + j * 2 * N * D;
        return PageRef<scalar_t>{k, k + N * D, D, 1};
      };
      pair<scalar_t>(page, lens[i], N, D, qp + i * D, scale, o + i * D, vm + i, sm + i, s);
    }
  });
}

// pairs read in place from the shadow [E, H, 2, sub·N, D] (keys channel-major [D][sub·N] when channel_major)
template <typename scalar_t>
void run_shadow(const torch::Tensor& shadow, bool channel_major, const int64_t* blocks, int64_t W,
                const int64_t* kv_heads, const int64_t* lens, const torch::Tensor& q, double scale, int64_t N,
                Outputs& res) {
  const int64_t n = q.size(0), D = q.size(1), H = shadow.size(1), run = shadow.size(3), sub = run / N;
  const scalar_t* base = shadow.data_ptr<scalar_t>();
  const double* qp = q.data_ptr<double>();
  double *o = res.out.data_ptr<double>(), *vm = res.v_max.data_ptr<double>(), *sm = res.s_max.data_ptr<double>();
  at::parallel_for(0, n, kPairsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<double> s;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = kv_heads[i];
      const int64_t* row = blocks + i * W;
      auto page = [&](int64_t j) {
        const int64_t b = row[j], e = b / sub, sb = b % sub;
        const scalar_t* keys = base + ((e * H + h) * 2) * run * D;
        const scalar_t* values = keys + run * D;
        if (channel_major) return PageRef<scalar_t>{keys + sb * N, values + sb * N * D, 1, run};
        return PageRef<scalar_t>{keys + sb * N * D, values + sb * N * D, D, 1};
      };
      pair<scalar_t>(page, lens[i], N, D, qp + i * D, scale, o + i * D, vm + i, sm + i, s);
    }
  });
}

template <typename F>
void by_dtype(at::ScalarType t, F&& f) {
  if (t == torch::kBFloat16) {
    f(at::BFloat16{});
  } else if (t == torch::kHalf) {
    f(at::Half{});
  } else {
    TORCH_CHECK(t == torch::kFloat, "shadow pages must be float16, bfloat16 or float32");
    f(float{});
  }
}

void check_pairs(const torch::Tensor& q, const torch::Tensor& lens) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kDouble && q.is_contiguous(), "q: contiguous [n, D] float64");
  TORCH_CHECK(lens.scalar_type() == torch::kLong && lens.is_contiguous() && lens.numel() == q.size(0),
              "lens: [n] int64");
}

}  // namespace

// kv [P, 2, N, D] float16/bfloat16/float32 (the pairs' gathered pages, each pair's consecutive from
// first_page[i]), first_page [n] int64, lens [n] int64 (tokens of each pair, at most its pages × N), q [n, D]
// float64. Returns (out [n, D], v_max [n], s_max [n]) float64.
std::vector<torch::Tensor> audit_reference_cpu(torch::Tensor kv, torch::Tensor first_page, torch::Tensor lens,
                                               torch::Tensor q, double scale) {
  TORCH_CHECK(kv.dim() == 4 && kv.size(1) == 2 && kv.is_contiguous() && !kv.is_cuda(), "kv: contiguous [P, 2, N, D]");
  check_pairs(q, lens);
  TORCH_CHECK(q.size(1) == kv.size(3), "q and kv disagree on D");
  TORCH_CHECK(first_page.scalar_type() == torch::kLong && first_page.is_contiguous() &&
                  first_page.numel() == q.size(0), "first_page: [n] int64");
  const int64_t n = q.size(0), P = kv.size(0), N = kv.size(2);
  const int64_t* fp = first_page.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(fp[i] >= 0 && ln[i] >= 0 && fp[i] * N + ln[i] <= P * N, "pair ", i, " reads past the gathered pages");
  Outputs res(n, q.size(1));
  by_dtype(kv.scalar_type(), [&](auto tag) { run_gathered<decltype(tag)>(kv, fp, ln, q, scale, res); });
  return res.list();
}

// shadow [E, H, 2, sub·N, D] contiguous (certvllm.kv.cache.LayerKVCache.shadow), blocks [n, W] int64 16-token
// block ids of each pair's row (columns [0, ⌈len/N⌉) are read), kv_heads [n], lens [n] int64, q [n, D] float64.
// Returns (out [n, D], v_max [n], s_max [n]) float64.
std::vector<torch::Tensor> audit_reference_shadow_cpu(torch::Tensor shadow, bool channel_major, torch::Tensor blocks,
                                                      torch::Tensor kv_heads, torch::Tensor lens, torch::Tensor q,
                                                      double scale, int64_t block_size) {
  TORCH_CHECK(shadow.dim() == 5 && shadow.size(2) == 2 && shadow.is_contiguous() && !shadow.is_cuda(),
              "shadow: contiguous [E, H, 2, sub*N, D]");
  check_pairs(q, lens);
  const int64_t n = q.size(0), N = block_size, W = blocks.size(1);
  TORCH_CHECK(N > 0 && shadow.size(3) % N == 0 && shadow.size(4) == q.size(1), "shadow disagrees with N or D");
  TORCH_CHECK(blocks.dim() == 2 && blocks.size(0) == n && blocks.scalar_type() == torch::kLong && blocks.is_contiguous(),
              "blocks: contiguous [n, W] int64");
  TORCH_CHECK(kv_heads.scalar_type() == torch::kLong && kv_heads.is_contiguous() && kv_heads.numel() == n,
              "kv_heads: [n] int64");
  const int64_t* bl = blocks.data_ptr<int64_t>();
  const int64_t* kh = kv_heads.data_ptr<int64_t>();
  const int64_t* ln = lens.data_ptr<int64_t>();
  const int64_t n_blocks = shadow.size(0) * (shadow.size(3) / N);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(ln[i] >= 0 && ln[i] <= W * N, "pair ", i, ": length outside its block-table row");
    TORCH_CHECK(kh[i] >= 0 && kh[i] < shadow.size(1), "pair ", i, ": KV head out of range");
    for (int64_t j = 0; j * N < ln[i]; ++j)
      TORCH_CHECK(bl[i * W + j] >= 0 && bl[i * W + j] < n_blocks, "pair ", i, ": block id out of range");
  }
  Outputs res(n, q.size(1));
  by_dtype(shadow.scalar_type(), [&](auto tag) {
    run_shadow<decltype(tag)>(shadow, channel_major, bl, W, kh, ln, q, scale, N, res);
  });
  return res.list();
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("audit_reference_cpu", &audit_reference_cpu, "Audit mode's float64 exact reference over gathered pages");
  m.def("audit_reference_shadow_cpu", &audit_reference_shadow_cpu,
        "Audit mode's float64 exact reference read in place from the shadow");
}
