#include "engine/plan/rope.hpp"

#include <algorithm>
#include <cmath>

namespace ds {

RotaryTables rotary_tables(const ModelHyper& hp, int64_t seq_len) {
  const int64_t D = hp.head_dim();
  const RopeScaling& s = hp.rope_scaling;
  const double pi = std::acos(-1.0);
  double base = hp.rope_theta;
  RotaryTables t;
  // dynamic (NTK): the base grows with the sequence once it is past the model's context.
  if (s.type == RopeType::dynamic && seq_len > hp.max_position_embeddings) {
    const double ratio = s.factor * static_cast<double>(seq_len) / static_cast<double>(hp.max_position_embeddings) - (s.factor - 1.0);
    base *= std::pow(ratio, static_cast<double>(D) / static_cast<double>(D - 2));
  }
  for (int64_t i = 0; i < D; i += 2) t.inv_freq.push_back(1.0 / std::pow(base, static_cast<double>(i) / static_cast<double>(D)));
  switch (s.type) {
    case RopeType::none:
    case RopeType::dynamic: break;
    case RopeType::longrope: {
      // Each frequency divided by its factor: the short list's within the original context, the long list's
      // past it; cos and sin scaled by sqrt(1 + ln(s) / ln(original)) for the stretch s = context / original.
      const int64_t original = s.original_max_position_embeddings;
      const std::vector<double>& ext = seq_len > original ? s.long_factor : s.short_factor;
      for (size_t j = 0; j < t.inv_freq.size() && j < ext.size(); ++j) t.inv_freq[j] /= ext[j];
      const double stretch = static_cast<double>(hp.max_position_embeddings) / static_cast<double>(original);
      t.attention_factor = s.attention_factor.value_or(stretch <= 1 ? 1.0 : std::sqrt(1 + std::log(stretch) / std::log(static_cast<double>(original))));
      break;
    }
    case RopeType::linear:  // positions divided by the factor, i.e. the frequencies
      for (double& f : t.inv_freq) f /= s.factor;
      break;
    case RopeType::llama3: {
      // Long wavelengths (past the old context / low_freq_factor) slowed by the factor, short ones (under
      // old context / high_freq_factor) kept, the band between interpolated by a smooth factor.
      const double old_context = static_cast<double>(s.original_max_position_embeddings);
      const double low_wavelen = old_context / s.low_freq_factor, high_wavelen = old_context / s.high_freq_factor;
      for (double& f : t.inv_freq) {
        const double wavelen = 2 * pi / f;
        if (wavelen > low_wavelen) {
          f /= s.factor;
        } else if (!(wavelen < high_wavelen)) {
          const double smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          f = (1 - smooth) * f / s.factor + smooth * f;
        }
      }
      break;
    }
    case RopeType::yarn: {
      // Each frequency blended between interpolated (/ factor) and kept by a ramp over the dimensions that
      // turn between beta_slow and beta_fast times within the context; cos and sin scaled by the attention factor.
      t.attention_factor = s.attention_factor.value_or(0.1 * std::log(s.factor) + 1.0);
      const double beta_fast = s.beta_fast.value_or(32), beta_slow = s.beta_slow.value_or(1);
      const double context = static_cast<double>(hp.max_position_embeddings);
      const auto correction_dim = [&](double rotations) {
        return static_cast<double>(D) * std::log(context / (rotations * 2 * pi)) / (2 * std::log(base));
      };
      const double low = std::max(std::floor(correction_dim(beta_fast)), 0.0);
      double high = std::min(std::ceil(correction_dim(beta_slow)), static_cast<double>(D - 1));
      if (low == high) high += 0.001;  // no division by zero
      for (size_t j = 0; j < t.inv_freq.size(); ++j) {
        const double ramp = std::clamp((static_cast<double>(j) - low) / (high - low), 0.0, 1.0);
        const double keep = 1.0 - ramp;  // extrapolation's share
        t.inv_freq[j] = t.inv_freq[j] / s.factor * (1.0 - keep) + t.inv_freq[j] * keep;
      }
      break;
    }
  }
  return t;
}

}  // namespace ds
