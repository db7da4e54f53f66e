// Certified attention over the tiered cache on the CPU: one fused pass per (row, KV head).
//
// This is the compiled twin of certvllm/attention/paged.py::_certified_rows (phase 1 INT8 scoring,
// top-K* selection with rung 1, rung-2 value promotion, phase 2 with unquantized keys/values read
// from the shadow tier, the certificate's terms, the rank/boundary/bound checks and the canary).
// Dense fallbacks (rungs 3/4) are applied by the Python caller, which owns the exact kernel.
//
// Arithmetic contract (docs/certification.md §5): scores are float32 dot products of D terms with
// k̂ = fma(code, σ, ℓ̃); weights are float32 exp(s − m); each block's weight sum and weighted value
// sum are float32 sums of 16 terms; blocks are combined in float64. Every bound term is evaluated in
// float64 from the same inputs, then rounded up to float32.
//
// Page byte layout: certvllm/formats/layout.py (offsets are passed in, not hard-coded).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <numeric>
#include <vector>

namespace {

constexpr int kN = 16;  // tokens per block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct Layout {
  int64_t page_bytes, v_codes, v_scale, v_zero, k_offset, k_scale_code, header, groups;
};

struct Consts {
  // bound constants computed in Python (certvllm/bounds) so there is one source of truth
  double c_delta, c_round, exp_c0, exp_c1, gamma_slack, round_factor, value_inflate, alpha_inflate;
  double tail_norm_inflate, budget_margin;
  // policy
  bool certified, rank_check, canary;
  double tau_cov, rung1_tail, key_tol, v_tol, bound_tol, eps_guard;
  int64_t k_min, k_max, k_max1, value_k_max, rank_depth, force_rung;
  bool key_budget;  // key_selection: budget (fewest blocks whose estimated E_key fits key_tol; group union)
};

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

template <typename T>
inline float to_f(T x) { return static_cast<float>(x); }

// log-space ᾱ = min(1, e^{2(Δ+R)}·α·GS)
inline double tail_mass_upper(double alpha, double delta, double rounding, double gs) {
  if (!(alpha > 0)) return alpha == 0 ? 0.0 : std::numeric_limits<double>::quiet_NaN();
  double log_a = std::log(alpha * gs) + 2.0 * (delta + rounding);
  return std::exp(std::min(log_a, 0.0));
}

inline double key_sum_bound(double alpha_up, double delta, double rounding, double gs) {
  if (std::isnan(delta + rounding)) return std::numeric_limits<double>::quiet_NaN();
  double tail_form = alpha_up > 0 ? alpha_up * (std::expm1(delta) + std::expm1(2.0 * delta)) + rounding : rounding;
  double full_form = 2.0 * std::tanh(0.5 * (delta + rounding));
  double best = std::fmin(tail_form, full_form) * gs;  // fmin ignores a NaN tail_form
  return std::fmin(best, 2.0);
}

inline float round_up_f(double x) {
  float f = static_cast<float>(x);
  if (static_cast<double>(f) < x) f = std::nextafter(f, std::numeric_limits<float>::infinity());
  return f;
}

template <typename scalar_t>
struct Shadow {
  const scalar_t* base;
  int64_t heads, sub, d;
  bool channel_major;
  // copy the 16 tokens of (block, head, which = 0 key / 1 value) into dst[t * d + c] as float
  inline void load(int64_t block, int64_t head, int which, int64_t ntok, float* dst) const {
    int64_t e = block / sub, s = block % sub, run = sub * kN;
    const scalar_t* p = base + ((e * heads + head) * 2 + which) * run * d;
    if (which == 0 && channel_major) {
      p += s * kN;  // [d][run]: channel c of token t at p[c * run + t]
      for (int64_t c = 0; c < d; ++c)
        for (int64_t t = 0; t < ntok; ++t) dst[t * d + c] = to_f(p[c * run + t]);
    } else {
      p += s * kN * d;
      for (int64_t i = 0; i < ntok * d; ++i) dst[i] = to_f(p[i]);
    }
  }
};

struct RowOut {
  bool precondition = false, canary = false;
  int64_t pagein_pages = 0, key_pages = 0, value_pages = 0;
  int64_t pagein_ns = 0;  // time in shadow reads (the partial block and the page-in union), this thread's
};

// Nanoseconds since ``start`` on the monotonic clock.
inline int64_t ns_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
}

template <typename scalar_t>
void certify_row_head(int64_t r, int64_t kh, const float* qs, int64_t G, int64_t D, const uint8_t* pages,
                      int64_t heads, int64_t sub, const Shadow<scalar_t>& shadow, const int64_t* table,
                      int64_t seq_len, const float* lut, const Layout& lay, const Consts& k,
                      const uint8_t* explore, int64_t explore_stride, float* out,
                      int8_t* rung, float* e_key, float* e_val, float* e_round, int32_t* k_star,
                      int32_t* v_prom, float* v_max_out, float* delta_tail_out, float* alpha_out, bool* rank_fail,
                      bool* boundary_fail, bool* bound_fail, RowOut& row) {
  const int64_t nf = seq_len / kN, nt = seq_len % kN, B = nf;
  std::vector<float> qa(G * D);
  for (int64_t i = 0; i < G * D; ++i) qa[i] = std::fabs(qs[i]);

  // ---------------- phase 1: INT8 keys of full blocks
  std::vector<float> s8(G * B * kN), delta(G * B), rnd(G * B), l8(G * B);
  std::vector<float> eta(B), nu(B);
  std::vector<float> khat(kN * D), sigma(D), mag(D);
  std::vector<const uint8_t*> page_of(B);
  for (int64_t b = 0; b < B; ++b) {
    int64_t bid = table[b];
    const uint8_t* pg = pages + ((bid / sub) * heads + kh) * sub * lay.page_bytes + (bid % sub) * lay.page_bytes;
    page_of[b] = pg;
    const uint8_t* hdr = pg + lay.header;
    float ann[2];
    std::memcpy(ann, hdr, 8);
    eta[b] = ann[0];
    nu[b] = ann[1];
    int exponent = static_cast<int8_t>(hdr[8]);
    uint8_t flags = hdr[9];
    if (!(flags & 1) || (flags & 2)) row.precondition = true;
    const uint16_t* off16 = reinterpret_cast<const uint16_t*>(pg + lay.k_offset);
    const float pow2 = std::ldexp(1.0f, exponent);
    const uint8_t* scode = pg + lay.k_scale_code;
    for (int64_t c = 0; c < D; ++c) {
      float sg = lut[scode[c]] * pow2;  // exact: a power of two
      float of = half_to_float(off16[c]);
      sigma[c] = sg;
      mag[c] = std::max(std::fabs(of), std::fabs(of + 255.0f * sg)) + sg;
      for (int t = 0; t < kN; ++t) khat[t * D + c] = static_cast<float>(pg[t * D + c]) * sg + of;
    }
    for (int64_t g = 0; g < G; ++g) {
      const float* qv = qs + g * D;
      const float* qg = qa.data() + g * D;
      // float32 sums of non-negative terms: c_delta and c_round carry the (1 + γ_{D+2}) inflation
      float dsum = 0.f, rsum = 0.f;
#pragma omp simd reduction(+ : dsum, rsum)
      for (int64_t c = 0; c < D; ++c) {
        dsum += qg[c] * sigma[c];
        rsum += qg[c] * mag[c];
      }
      delta[g * B + b] = round_up_f(static_cast<double>(dsum) * k.c_delta);
      rnd[g * B + b] = round_up_f(static_cast<double>(rsum) * k.c_round);
      float mx = kNegInf;
      for (int t = 0; t < kN; ++t) {
        float s = 0.f;
        const float* kt = khat.data() + t * D;
#pragma omp simd reduction(+ : s)
        for (int64_t c = 0; c < D; ++c) s += qv[c] * kt[c];
        s8[(g * B + b) * kN + t] = s;
        mx = std::max(mx, s);
      }
      float se = 0.f;  // phase-1 log-mass: feeds the selection heuristics only
      for (int t = 0; t < kN; ++t) se += std::exp(s8[(g * B + b) * kN + t] - mx);
      l8[g * B + b] = mx + std::log(se);
    }
  }

  // ---------------- trailing partial block: exact keys and values from the shadow
  std::vector<float> kt(nt * D), vt(nt * D);
  int64_t tail_bid = nt > 0 ? table[nf] : -1;
  double tail_vnorm = 0;
  if (nt > 0) {
    auto t0 = std::chrono::steady_clock::now();
    shadow.load(tail_bid, kh, 0, nt, kt.data());
    shadow.load(tail_bid, kh, 1, nt, vt.data());
    row.pagein_ns += ns_since(t0);
  }
  for (int64_t t = 0; t < nt; ++t) {
    double nrm = 0;
    for (int64_t c = 0; c < D; ++c) nrm += static_cast<double>(vt[t * D + c]) * vt[t * D + c];
    tail_vnorm = std::max(tail_vnorm, std::sqrt(nrm));
  }
  if (nt > 0) row.pagein_pages += 1;
  std::vector<float> s_tail(G * kN, kNegInf), l_tail(G, kNegInf), tail_round(G, 0.f);
  std::vector<float> kt_abs_max(D, 0.f);
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t c = 0; c < D; ++c) kt_abs_max[c] = std::max(kt_abs_max[c], std::fabs(kt[t * D + c]));
  for (int64_t g = 0; g < G; ++g) {
    const float* qv = qs + g * D;
    double rsum = 0;
    for (int64_t c = 0; c < D; ++c) rsum += static_cast<double>(qa[g * D + c]) * kt_abs_max[c];
    tail_round[g] = round_up_f(rsum * k.c_round);
    float mx = kNegInf;
    for (int64_t t = 0; t < nt; ++t) {
      float s = 0.f;
      const float* kk = kt.data() + t * D;
      // the same reduction as the promoted blocks' exact scores: equal keys get equal scores
#pragma omp simd reduction(+ : s)
      for (int64_t c = 0; c < D; ++c) s += qv[c] * kk[c];
      s_tail[g * kN + t] = s;
      mx = std::max(mx, s);
    }
    if (nt > 0) {
      double se = 0;
      for (int64_t t = 0; t < nt; ++t) se += std::exp(static_cast<double>(s_tail[g * kN + t]) - mx);
      l_tail[g] = static_cast<float>(mx + std::log(se));
    }
  }

  double v_max = round_up_f(tail_vnorm * k.tail_norm_inflate), eta_max = 0;
  for (int64_t b = 0; b < B; ++b) {
    v_max = std::max(v_max, static_cast<double>(nu[b]));
    eta_max = std::max(eta_max, static_cast<double>(eta[b]));
  }

  // ---------------- phase-1 masses and the rounding R per head
  std::vector<double> p(G * B), base_round(G), round1(G);
  for (int64_t g = 0; g < G; ++g) {
    double amax = 0, rmax = tail_round[g];
    for (int64_t i = 0; i < B * kN; ++i) amax = std::max(amax, static_cast<double>(std::fabs(s8[g * B * kN + i])));
    for (int64_t t = 0; t < nt; ++t) amax = std::max(amax, static_cast<double>(std::fabs(s_tail[g * kN + t])));
    for (int64_t b = 0; b < B; ++b) rmax = std::max(rmax, static_cast<double>(rnd[g * B + b]));
    base_round[g] = rmax;
    round1[g] = rmax + (k.exp_c1 * amax + k.exp_c0);
    double mx = l_tail[g];
    for (int64_t b = 0; b < B; ++b) mx = std::max(mx, static_cast<double>(l8[g * B + b]));
    double se = std::isinf(static_cast<double>(l_tail[g])) ? 0.0 : std::exp(l_tail[g] - mx);
    for (int64_t b = 0; b < B; ++b) se += std::exp(static_cast<double>(l8[g * B + b]) - mx);
    double lse = mx + std::log(se);
    for (int64_t b = 0; b < B; ++b) p[g * B + b] = std::exp(static_cast<double>(l8[g * B + b]) - lse);
  }

  // ---------------- selection: top-K* (+ rung 1) and rung-2 values
  std::vector<uint8_t> key_mask(G * B, 0), value_mask(G * B, 0), widened(G, 0);
  if (k.certified && B > 0) {
    std::vector<int64_t> order(B);
    std::vector<double> alpha_hat(B + 1), dsuf(B + 1), est(B + 1);
    for (int64_t g = 0; g < G; ++g) {
      const double* pg = p.data() + g * B;
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b2) { return pg[a] > pg[b2]; });
      alpha_hat[B] = 0;
      dsuf[B] = 0;
      for (int64_t i = B - 1; i >= 0; --i) {
        alpha_hat[i] = alpha_hat[i + 1] + pg[order[i]];
        dsuf[i] = std::max(dsuf[i + 1], static_cast<double>(delta[g * B + order[i]]));
      }
      double dall = dsuf[0];
      for (int64_t i = 0; i <= B; ++i) {
        double abar = tail_mass_upper(alpha_hat[i], dall, round1[g], k.gamma_slack);
        double growth = std::expm1(dsuf[i]) + std::expm1(2.0 * dsuf[i]);
        est[i] = abar > 0 ? abar * growth : 0.0;
      }
      int64_t kmin = std::min<int64_t>(k.k_min, B), kmax = std::min<int64_t>(k.k_max, B);
      int64_t base = k.key_budget ? kmax : B;
      for (int64_t i = k.key_budget ? kmin : 0; i <= B; ++i)
        if (k.key_budget ? est[i] <= k.key_tol : alpha_hat[i] <= 1.0 - k.tau_cov) { base = i; break; }
      base = std::max(std::min(base, kmax), kmin);
      bool trigger = est[base] > k.key_tol || (!k.key_budget && alpha_hat[base] > k.rung1_tail);
      int64_t kmax1 = std::min<int64_t>(k.k_max1, B);
      int64_t kstar = base;
      if (trigger) {
        int64_t wide = kmax1;
        for (int64_t i = base; i <= kmax1; ++i)
          if (est[i] <= k.key_tol && (k.key_budget || alpha_hat[i] <= k.rung1_tail)) { wide = i; break; }
        kstar = std::max(wide, base);
      }
      widened[g] = kstar > base;
      for (int64_t i = 0; i < kstar; ++i) key_mask[g * B + order[i]] = 1;
      if (explore != nullptr && !k.key_budget)  // exploration: extra promoted key blocks drawn by the caller
        for (int64_t b = 0; b < B; ++b) key_mask[g * B + b] |= explore[g * explore_stride + b];

      // rung 2: greedy by ρ̄_b·η_b until the rest is within v_tol·V_max (1 % margin)
      double xi = dall + 3.0 * round1[g];
      std::vector<double> err(B);
      for (int64_t b = 0; b < B; ++b) err[b] = tail_mass_upper(pg[b], xi, 0.0, k.gamma_slack) * eta[b];
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b2) { return err[a] > err[b2]; });
      double budget = k.v_tol * v_max / k.budget_margin;
      std::vector<double> rem(B + 1, 0.0);
      for (int64_t i = B - 1; i >= 0; --i) rem[i] = rem[i + 1] + err[order[i]];
      int64_t count = B;
      for (int64_t i = 0; i <= B; ++i)
        if (rem[i] <= budget) { count = i; break; }
      if (k.value_k_max >= 0) count = std::min(count, k.value_k_max);
      for (int64_t i = 0; i < count; ++i) value_mask[g * B + order[i]] = 1;
    }
    if (k.key_budget) {  // every query head of the KV head reads the union of the group's blocks, then explores
      for (int64_t b = 0; b < B; ++b) {
        uint8_t any = 0;
        for (int64_t g = 0; g < G; ++g) any |= key_mask[g * B + b];
        for (int64_t g = 0; g < G; ++g) key_mask[g * B + b] = any;
      }
      if (explore != nullptr)
        for (int64_t g = 0; g < G; ++g)
          for (int64_t b = 0; b < B; ++b) key_mask[g * B + b] |= explore[g * explore_stride + b];
    }
  }

  // ---------------- page-in (union over the group's heads) and phase 2
  std::vector<uint8_t> has16(B, 0);
  std::vector<int64_t> slot16(B, -1);
  int64_t n_union = 0;
  for (int64_t b = 0; b < B; ++b) {
    bool u = false;
    for (int64_t g = 0; g < G; ++g) u |= key_mask[g * B + b] || value_mask[g * B + b];
    if (u) slot16[b] = n_union++;
  }
  std::unique_ptr<float[]> k16(new float[std::max<int64_t>(n_union, 1) * kN * D]);
  std::unique_ptr<float[]> v16(new float[std::max<int64_t>(n_union, 1) * kN * D]);
  auto union_start = std::chrono::steady_clock::now();
  for (int64_t b = 0; b < B; ++b) {
    bool any = false, anyk = false, anyv = false;
    for (int64_t g = 0; g < G; ++g) {
      anyk |= key_mask[g * B + b];
      anyv |= value_mask[g * B + b];
    }
    any = anyk || anyv;
    row.key_pages += anyk;  // (block, KV head) pages: the union over the group, as the other paths count
    row.value_pages += anyv;
    if (!any) continue;
    has16[b] = 1;
    row.pagein_pages += 1;
    shadow.load(table[b], kh, 0, kN, k16.get() + slot16[b] * kN * D);
    shadow.load(table[b], kh, 1, kN, v16.get() + slot16[b] * kN * D);
  }
  if (n_union > 0) row.pagein_ns += ns_since(union_start);

  // dequantized values of the blocks some head reads as INT4, decoded once per block
  std::unique_ptr<float[]> vhat(new float[std::max<int64_t>(B, 1) * kN * D]);
  std::vector<uint8_t> need_int4(B, 0);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t b = 0; b < B; ++b) need_int4[b] |= !value_mask[g * B + b];
  for (int64_t b = 0; b < B; ++b) {
    if (!need_int4[b]) continue;
    const uint8_t* pg = page_of[b];
    const uint8_t* vc = pg + lay.v_codes;
    const uint16_t* vs = reinterpret_cast<const uint16_t*>(pg + lay.v_scale);
    const uint16_t* vz = reinterpret_cast<const uint16_t*>(pg + lay.v_zero);
    const int64_t gs = D / lay.groups;
    float* dst = vhat.get() + b * kN * D;
    for (int t = 0; t < kN; ++t)
      for (int64_t grp = 0; grp < lay.groups; ++grp) {
        const float scl = half_to_float(vs[t * lay.groups + grp]), zer = half_to_float(vz[t * lay.groups + grp]);
        const uint8_t* bytes = vc + t * (D / 2) + grp * (gs / 2);
        float* o = dst + t * D + grp * gs;
        for (int64_t j = 0; j < gs / 2; ++j) {  // even element in the low nibble
          const uint8_t byte = bytes[j];
          o[2 * j] = static_cast<float>(byte & 0x0F) * scl + zer;  // code·scale is exact: one rounding
          o[2 * j + 1] = static_cast<float>(byte >> 4) * scl + zer;
        }
      }
  }
  std::vector<double> rho(G * B), den_b_d(G * B);
  std::vector<float> lm_exact(G * B, kNegInf);
  for (int64_t g = 0; g < G; ++g) {
    const float* qv = qs + g * D;
    // scores of phase 2 (exact where this head promoted the keys) and the canary
    std::vector<float> s2(B * kN);
    float mx = kNegInf, amax = 0.f;
    for (int64_t b = 0; b < B; ++b) {
      bool exact_keys = key_mask[g * B + b];
      for (int t = 0; t < kN; ++t) {
        float s8v = s8[(g * B + b) * kN + t];
        float s = s8v;
        if (has16[b]) {
          float se = 0.f;
          const float* kk = k16.get() + (slot16[b] * kN + t) * D;
#pragma omp simd reduction(+ : se)
          for (int64_t c = 0; c < D; ++c) se += qv[c] * kk[c];
          if (k.certified && k.canary) {  // every paged-in block carries both scores
            double allowed = (static_cast<double>(delta[g * B + b]) + 2.0 * round1[g]) * (1.0 + std::ldexp(1.0, -10));
            double diff = std::fabs(static_cast<double>(se) - s8v);
            if (!(diff <= allowed)) row.canary = true;
          }
          if (exact_keys) s = se;
        }
        s2[b * kN + t] = s;
        mx = std::max(mx, s);
        amax = std::max(amax, std::fabs(s));
      }
    }
    for (int64_t t = 0; t < nt; ++t) {
      mx = std::max(mx, s_tail[g * kN + t]);
      amax = std::max(amax, std::fabs(s_tail[g * kN + t]));
    }
    std::vector<double> num(D, 0.0);
    double den = 0.0;
    std::vector<float> den_b(B), nb(D);
    for (int64_t b = 0; b < B; ++b) {
      const float* vals = value_mask[g * B + b] ? v16.get() + slot16[b] * kN * D : vhat.get() + b * kN * D;
      float db = 0.f;
      std::fill(nb.begin(), nb.end(), 0.f);
      for (int t = 0; t < kN; ++t) {
        float w = std::exp(s2[b * kN + t] - mx);
        db += w;
        const float* vv = vals + t * D;
        for (int64_t c = 0; c < D; ++c) nb[c] += w * vv[c];
      }
      den_b[b] = db;
      den += db;
      for (int64_t c = 0; c < D; ++c) num[c] += nb[c];
      if (key_mask[g * B + b]) lm_exact[g * B + b] = mx + std::log(db);
    }
    float den_t = 0.f;
    std::fill(nb.begin(), nb.end(), 0.f);
    for (int64_t t = 0; t < nt; ++t) {
      float w = std::exp(s_tail[g * kN + t] - mx);
      den_t += w;
      for (int64_t c = 0; c < D; ++c) nb[c] += w * vt[t * D + c];
    }
    den += den_t;
    for (int64_t c = 0; c < D; ++c) num[c] += nb[c];
    float* o = out + g * D;
    for (int64_t c = 0; c < D; ++c) o[c] = static_cast<float>(num[c] / den);

    // ---------------- the certificate
    double e_v = 0.0, alpha = 0.0, dtail = 0.0;
    int32_t nk = 0, nv = 0;
    for (int64_t b = 0; b < B; ++b) {
      double rb = static_cast<double>(den_b[b]) / den;
      if (!value_mask[g * B + b]) e_v += rb * eta[b];
      if (!key_mask[g * B + b]) {
        alpha += rb;
        dtail = std::max(dtail, static_cast<double>(delta[g * B + b]));
      }
      nk += key_mask[g * B + b];
      nv += value_mask[g * B + b];
    }
    double ev = e_v * k.value_inflate;
    alpha *= k.alpha_inflate;
    double round2 = base_round[g] + (k.exp_c1 * amax + k.exp_c0);
    double alpha_up = tail_mass_upper(alpha, dtail, round2, k.gamma_slack);
    double S = key_sum_bound(alpha_up, dtail, round2, k.gamma_slack);
    double er = k.round_factor * (v_max + eta_max);
    double ek = v_max * S * k.gamma_slack + er;
    float ek_f = round_up_f(ek), ev_f = round_up_f(ev);
    e_key[g] = ek_f;
    e_val[g] = ev_f;
    e_round[g] = round_up_f(er);
    k_star[g] = nk;
    v_prom[g] = nv;
    v_max_out[g] = static_cast<float>(v_max);
    delta_tail_out[g] = static_cast<float>(dtail);
    alpha_out[g] = static_cast<float>(alpha_up);

    // ---------------- checks
    bool rf = false, bf = false;
    if (k.certified && k.rank_check) {
      // F = key-promoted full blocks plus the partial block (exact in both phases)
      std::vector<std::pair<float, float>> f;  // (exact, int8) log-masses
      for (int64_t b = 0; b < B; ++b)
        if (key_mask[g * B + b]) f.emplace_back(lm_exact[g * B + b], l8[g * B + b]);
      if (nt > 0) f.emplace_back(mx + std::log(den_t), l_tail[g]);
      int64_t r = std::min<int64_t>(k.rank_depth, B + 1);
      int64_t nfs = static_cast<int64_t>(f.size());
      std::vector<float> by_exact, by_int8;
      {
        std::vector<int64_t> idx(nfs);
        std::iota(idx.begin(), idx.end(), 0);
        std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b2) { return f[a].first > f[b2].first; });
        for (int64_t j = 0; j < std::min(r, nfs); ++j) by_exact.push_back(f[idx[j]].first);
        std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b2) { return f[a].second > f[b2].second; });
        for (int64_t j = 0; j < std::min(r, nfs); ++j) by_int8.push_back(f[idx[j]].first);
      }
      for (size_t j = 0; j < by_exact.size(); ++j)
        if (std::isfinite(by_exact[j]) && by_int8[j] < by_exact[j] - k.eps_guard) rf = true;
      if (!by_exact.empty()) {
        float threshold = std::numeric_limits<float>::infinity();
        for (float x : by_exact)
          if (std::isfinite(x)) threshold = std::min(threshold, x);
        if (std::isfinite(threshold))
          for (int64_t b = 0; b < B; ++b)
            if (!key_mask[g * B + b] && l8[g * B + b] + delta[g * B + b] + 2.0 * round2 > threshold) bf = true;
      }
    }
    rank_fail[g] = rf;
    boundary_fail[g] = bf;
    double bound = static_cast<double>(ek_f) + ev_f;
    bool bfail = k.certified && (!(bound <= k.bound_tol * v_max) || !std::isfinite(bound));
    bound_fail[g] = bfail;
    int8_t rg = 0;
    if (widened[g]) rg = 1;
    if (nv > 0) rg = 2;
    if (k.certified && (rf || bf || bfail)) rg = 3;
    rung[g] = rg;
  }
}

template <typename scalar_t>
void run(const torch::Tensor& qs, const torch::Tensor& pages, const torch::Tensor& shadow_t, bool channel_major,
         const torch::Tensor& tables, const torch::Tensor& seq_lens, const torch::Tensor& lut, const Layout& lay,
         const Consts& k, const torch::Tensor& explore, torch::Tensor& out, std::vector<torch::Tensor>& rep,
         std::vector<RowOut>& rows) {
  const int64_t R = qs.size(0), K = qs.size(1), G = qs.size(2), D = qs.size(3);
  const int64_t heads = pages.size(1);
  const int64_t sub = shadow_t.size(3) / kN;
  Shadow<scalar_t> shadow{shadow_t.data_ptr<scalar_t>(), heads, sub, D, channel_major};
  const float* q = qs.data_ptr<float>();
  const uint8_t* pg = pages.data_ptr<uint8_t>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const float* lt = lut.data_ptr<float>();
  float* o = out.data_ptr<float>();
  int64_t MB = tables.size(1);
  const bool has_explore = explore.numel() > 0;  // [R, K, G, Bx] uint8
  const uint8_t* ex = has_explore ? explore.data_ptr<uint8_t>() : nullptr;
  const int64_t ex_b = has_explore ? explore.size(3) : 0;
  std::vector<RowOut> per(R * K);
  at::parallel_for(0, R * K, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      int64_t r = i / K, kh = i % K, h0 = r * K * G + kh * G;
      certify_row_head<scalar_t>(
          r, kh, q + i * G * D, G, D, pg, heads, sub, shadow, tb + r * MB, sl[r], lt, lay, k,
          has_explore ? ex + i * G * ex_b : nullptr, ex_b, o + h0 * D,
          rep[0].data_ptr<int8_t>() + h0, rep[1].data_ptr<float>() + h0, rep[2].data_ptr<float>() + h0,
          rep[3].data_ptr<float>() + h0, rep[4].data_ptr<int32_t>() + h0, rep[5].data_ptr<int32_t>() + h0,
          rep[6].data_ptr<float>() + h0, rep[7].data_ptr<float>() + h0, rep[8].data_ptr<float>() + h0,
          rep[9].data_ptr<bool>() + h0, rep[10].data_ptr<bool>() + h0, rep[11].data_ptr<bool>() + h0, per[i]);
    }
  });
  rows.assign(R, RowOut{});
  for (int64_t i = 0; i < R * K; ++i) {
    RowOut& dst = rows[i / K];
    dst.precondition |= per[i].precondition;
    dst.canary |= per[i].canary;
    dst.pagein_pages += per[i].pagein_pages;
    dst.key_pages += per[i].key_pages;
    dst.value_pages += per[i].value_pages;
    dst.pagein_ns += per[i].pagein_ns;
  }
}

}  // namespace

// Returns (out [R, Hq, D] float32, report tensors..., row flags [R, 2] bool, counters [5] int64: pages read,
// key and value pages promoted, nanoseconds in shadow reads summed over threads, threads).
std::vector<torch::Tensor> certified_decode_cpu(torch::Tensor qs, torch::Tensor pages, torch::Tensor shadow,
                                                bool channel_major, torch::Tensor tables, torch::Tensor seq_lens,
                                                torch::Tensor lut, std::vector<int64_t> layout,
                                                std::vector<double> consts, std::vector<int64_t> policy,
                                                torch::Tensor explore) {
  TORCH_CHECK(qs.is_contiguous() && qs.scalar_type() == torch::kFloat && qs.dim() == 4, "qs: [R, K, G, D] float32");
  TORCH_CHECK(pages.is_contiguous() && pages.scalar_type() == torch::kByte, "pages: contiguous uint8");
  TORCH_CHECK(shadow.is_contiguous() && shadow.dim() == 5, "shadow: contiguous [E, H, 2, m*16, D]");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && seq_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(layout.size() == 8 && consts.size() == 16 && policy.size() == 10, "bad constant vectors");
  tables = tables.contiguous();
  explore = explore.contiguous();
  TORCH_CHECK(explore.numel() == 0 || (explore.scalar_type() == torch::kByte && explore.dim() == 4),
              "explore: empty or [R, K, G, B] uint8");
  Layout lay{layout[0], layout[1], layout[2], layout[3], layout[4], layout[5], layout[6], layout[7]};
  Consts k{consts[0], consts[1], consts[2], consts[3], consts[4], consts[5], consts[6], consts[7], consts[8],
           consts[9], policy[0] != 0, policy[1] != 0, policy[2] != 0, consts[10], consts[11], consts[12],
           consts[13], consts[14], consts[15], policy[3], policy[4], policy[5], policy[6], policy[7], policy[8],
           policy[9] != 0};
  const int64_t R = qs.size(0), K = qs.size(1), G = qs.size(2), D = qs.size(3);
  auto out = torch::zeros({R, K * G, D}, torch::kFloat);
  auto f = torch::TensorOptions();
  std::vector<torch::Tensor> rep = {
      torch::zeros({R, K * G}, f.dtype(torch::kChar)),  torch::zeros({R, K * G}, f.dtype(torch::kFloat)),
      torch::zeros({R, K * G}, f.dtype(torch::kFloat)), torch::zeros({R, K * G}, f.dtype(torch::kFloat)),
      torch::zeros({R, K * G}, f.dtype(torch::kInt)),   torch::zeros({R, K * G}, f.dtype(torch::kInt)),
      torch::zeros({R, K * G}, f.dtype(torch::kFloat)), torch::zeros({R, K * G}, f.dtype(torch::kFloat)),
      torch::zeros({R, K * G}, f.dtype(torch::kFloat)), torch::zeros({R, K * G}, f.dtype(torch::kBool)),
      torch::zeros({R, K * G}, f.dtype(torch::kBool)),  torch::zeros({R, K * G}, f.dtype(torch::kBool))};
  std::vector<RowOut> rows;
  if (shadow.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(qs, pages, shadow, channel_major, tables, seq_lens, lut, lay, k, explore, out, rep, rows);
  } else if (shadow.scalar_type() == torch::kFloat) {  // float32 activations (CPUs without native bf16)
    run<float>(qs, pages, shadow, channel_major, tables, seq_lens, lut, lay, k, explore, out, rep, rows);
  } else {
    TORCH_CHECK(shadow.scalar_type() == torch::kHalf, "shadow must be float16, bfloat16 or float32");
    run<at::Half>(qs, pages, shadow, channel_major, tables, seq_lens, lut, lay, k, explore, out, rep, rows);
  }
  auto flags = torch::zeros({R, 2}, f.dtype(torch::kBool));
  auto counters = torch::zeros({5}, f.dtype(torch::kLong));
  int64_t pages_in = 0, kp = 0, vp = 0, ns = 0;
  for (int64_t r = 0; r < R; ++r) {
    flags[r][0] = rows[r].precondition;
    flags[r][1] = rows[r].canary;
    pages_in += rows[r].pagein_pages;
    kp += rows[r].key_pages;
    vp += rows[r].value_pages;
    ns += rows[r].pagein_ns;
  }
  counters[0] = pages_in;
  counters[1] = kp;
  counters[2] = vp;
  counters[3] = ns;                          // summed over the threads that read
  counters[4] = at::get_num_threads();       // that ran them: ns / threads ≈ wall time of the reads
  rep.insert(rep.begin(), out);
  rep.push_back(flags);
  rep.push_back(counters);
  return rep;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("certified_decode_cpu", &certified_decode_cpu, "Certified attention rows over the tiered cache (CPU)");
}
