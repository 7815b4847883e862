// The model families of schema/arch.hpp as ds computes them, against a forward written here from Hugging
// Face's modeling files in plain LibTorch ops (matmul, softmax, a mask), in double precision: for each
// family a tiny model with every one of its features on (biases, per-head q/k norms, a head width of its
// own, grouped-query attention, a window) gives ds's fp32 loss and every parameter's gradient.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>

#include "common/cpu_features.hpp"
#include "engine/plan/memory.hpp"
#include "engine/runtime/device/block_pool.hpp"
#include "engine/runtime/device/device.hpp"
#include "engine/runtime/run/flat_params.hpp"
#include "engine/runtime/model/fused_head_loss.hpp"
#include "engine/runtime/model/language_model.hpp"
#include "test_helpers.hpp"

using namespace ds;

namespace {

const char* kConfig = R"({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
  "bf16": {"enabled": false}, "model": {"preset": "llama-tiny"}, "data": {"type": "synthetic", "seq_len": 12},
  "train": {"steps": 1, "eval_every": 0, "threads": 1, "seed": 3}})";

using Weights = std::map<std::string, torch::Tensor>;

// Llama's RMSNorm, or Gemma's x / rms(x) * (1 + g).
bool g_plus_one = false;
torch::Tensor rms(const torch::Tensor& x, const torch::Tensor& g, double eps) {
  return (g_plus_one ? g + 1 : g) * (x * torch::rsqrt(x.pow(2).mean(-1, true) + eps));
}

// nn.Linear: x w^T (+ b where the model has one).
torch::Tensor project(const Weights& w, const std::string& name, const torch::Tensor& x) {
  torch::Tensor y = torch::matmul(x, w.at(name + ".weight").t());
  if (w.count(name + ".bias")) y = y + w.at(name + ".bias");
  return y;
}

// Hugging Face's apply_rotary_pos_emb: x cos + rotate_half(x) sin, the angles t theta^(-2j/D) repeated for both halves.
torch::Tensor rope(const torch::Tensor& x, double theta) {  // x (B, T, H, D)
  const int64_t T = x.size(1), D = x.size(3);
  const torch::Tensor inv = torch::pow(theta, -torch::arange(0, D, 2, torch::kFloat64) / static_cast<double>(D));
  const torch::Tensor angles = torch::outer(torch::arange(T, torch::kFloat64), inv);
  const torch::Tensor full = torch::cat({angles, angles}, -1).view({1, T, 1, D});
  const torch::Tensor x1 = x.narrow(-1, 0, D / 2), x2 = x.narrow(-1, D / 2, D / 2);
  return x * full.cos() + torch::cat({-x2, x1}, -1) * full.sin();
}

// The mean next-token cross-entropy of a rotary-family model with weights `w` (double, by state_dict name).
torch::Tensor reference_loss(const ModelHyper& hp, const Weights& w, const torch::Tensor& in, const torch::Tensor& tgt) {
  const int64_t B = in.size(0), T = in.size(1), NH = hp.num_heads, NKV = hp.num_kv_heads, D = hp.head_dim();
  const double eps = hp.norm_eps;
  const bool gemma = hp.arch == ModelArch::gemma || hp.arch == ModelArch::gemma2, gemma2 = hp.arch == ModelArch::gemma2;
  g_plus_one = gemma;
  torch::Tensor x = w.at("model.embed_tokens.weight").index_select(0, in.flatten()).view({B, T, hp.hidden_size});
  if (gemma) x = x * static_cast<double>(static_cast<float>(std::sqrt(static_cast<double>(hp.hidden_size))));  // normalizer in fp32
  const torch::Tensor pos = torch::arange(T);
  for (int64_t l = 0; l < hp.num_layers; ++l) {
    // Who each query sees: earlier positions, and within the window when the layer has one (Gemma 2: even layers).
    torch::Tensor allowed = pos.view({T, 1}) >= pos.view({1, T});
    if (hp.sliding_window > 0 && (!gemma2 || l % 2 == 0)) allowed = allowed & (pos.view({1, T}) > pos.view({T, 1}) - hp.sliding_window);
    const std::string p = "model.layers." + std::to_string(l) + ".";
    torch::Tensor h = rms(x, w.at(p + "input_layernorm.weight"), eps);
    torch::Tensor q, k, v;
    if (w.count(p + "self_attn.qkv_proj.weight")) {  // Phi-3: the last dimension is q | k | v
      const torch::Tensor qkv = project(w, p + "self_attn.qkv_proj", h);
      q = qkv.narrow(-1, 0, NH * D).reshape({B, T, NH, D});
      k = qkv.narrow(-1, NH * D, NKV * D).reshape({B, T, NKV, D});
      v = qkv.narrow(-1, (NH + NKV) * D, NKV * D).reshape({B, T, NKV, D});
    } else {
      q = project(w, p + "self_attn.q_proj", h).view({B, T, NH, D});
      k = project(w, p + "self_attn.k_proj", h).view({B, T, NKV, D});
      v = project(w, p + "self_attn.v_proj", h).view({B, T, NKV, D});
    }
    if (w.count(p + "self_attn.q_norm.weight")) {
      q = rms(q, w.at(p + "self_attn.q_norm.weight"), eps);
      k = rms(k, w.at(p + "self_attn.k_norm.weight"), eps);
    }
    q = rope(q, hp.rope_theta).transpose(1, 2);  // (B, NH, T, D)
    k = rope(k, hp.rope_theta).transpose(1, 2).repeat_interleave(NH / NKV, 1);
    const torch::Tensor vv = v.transpose(1, 2).repeat_interleave(NH / NKV, 1);
    const double scalar = gemma2 && hp.query_pre_attn_scalar > 0 ? hp.query_pre_attn_scalar : static_cast<double>(D);
    torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2)) / std::sqrt(scalar);
    if (hp.attn_softcap > 0) scores = torch::tanh(scores / hp.attn_softcap) * hp.attn_softcap;
    scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
    const torch::Tensor y = torch::matmul(torch::softmax(scores, -1), vv).transpose(1, 2).reshape({B, T, NH * D});
    torch::Tensor o = project(w, p + "self_attn.o_proj", y);
    if (gemma2) o = rms(o, w.at(p + "post_attention_layernorm.weight"), eps);
    x = x + o;
    h = rms(x, w.at(p + (gemma2 ? "pre_feedforward_layernorm.weight" : "post_attention_layernorm.weight")), eps);
    torch::Tensor gated;
    if (w.count(p + "mlp.gate_up_proj.weight")) {  // Phi-3: gate, up = gate_up_proj(h).chunk(2, -1)
      const auto halves = project(w, p + "mlp.gate_up_proj", h).chunk(2, -1);
      gated = torch::silu(halves[0]) * halves[1];
    } else if (gemma) {  // GeGLU with the tanh GELU
      gated = torch::gelu(project(w, p + "mlp.gate_proj", h), "tanh") * project(w, p + "mlp.up_proj", h);
    } else {
      gated = torch::silu(project(w, p + "mlp.gate_proj", h)) * project(w, p + "mlp.up_proj", h);
    }
    torch::Tensor f = project(w, p + "mlp.down_proj", gated);
    if (gemma2) f = rms(f, w.at(p + "post_feedforward_layernorm.weight"), eps);
    x = x + f;
  }
  x = rms(x, w.at("model.norm.weight"), eps);
  const torch::Tensor head = w.count("lm_head.weight") ? w.at("lm_head.weight") : w.at("model.embed_tokens.weight");
  torch::Tensor logits = torch::matmul(x, head.t());
  if (hp.final_softcap > 0) logits = torch::tanh(logits / hp.final_softcap) * hp.final_softcap;
  return torch::cross_entropy_loss(logits.view({B * T, -1}), tgt.flatten(), {}, at::Reduction::Mean, /*ignore_index=*/-1);
}

// ds's fp32 loss and every parameter's gradient against reference_loss in double (1e-5 relative for the
// loss, 1e-4 of the largest gradient for each tensor). Returns ds's loss.
double expect_reference_loss_and_gradients(const Plan& plan, FlatParams& flat, LanguageModel& model, const torch::Tensor& in,
                                           const torch::Tensor& tgt) {
  flat.grads.zero_();
  model.set_loss_gradient(1.0);
  const torch::Tensor loss = model.loss(in, tgt);
  loss.backward();
  Weights w;
  for (const ParamSlot& s : plan.layout.params)
    w[s.name] = flat.params.narrow(0, s.offset, s.numel).view(s.shape).to(torch::kFloat64).detach().requires_grad_(true);
  const torch::Tensor want = reference_loss(plan.model.hp, w, in, tgt);
  want.backward();
  EXPECT_NEAR(loss.item<double>(), want.item<double>(), 1e-5 * want.item<double>());
  for (const ParamSlot& s : plan.layout.params) {
    const torch::Tensor ref = w.at(s.name).grad().flatten();
    const torch::Tensor got = flat.grads.narrow(0, s.offset, s.numel).to(torch::kFloat64);
    const double scale = std::max(ref.abs().max().item<double>(), 1e-6);
    EXPECT_LT((got - ref).abs().max().item<double>() / scale, 1e-4) << s.name;
  }
  return loss.item<double>();
}

struct Family {
  const char* what;
  std::vector<std::string> overrides;
  std::vector<std::string> must_have;  // tensors the family adds to Llama's
};

const std::vector<Family>& families() {
  static const std::vector<Family> f = {
      {"llama with attention_bias, mlp_bias and a head width of its own",
       {"model.preset=llama-tiny", "model.attention_bias=true", "model.mlp_bias=true", "model.head_dim=24", "model.tie_word_embeddings=false"},
       {"model.layers.0.self_attn.o_proj.bias", "model.layers.1.mlp.down_proj.bias", "lm_head.weight"}},
      {"mistral: its window of 64 holds the 12 positions", {"model.preset=mistral-tiny"}, {}},
      {"mistral with a window of 5 on 12 positions", {"model.preset=mistral-tiny", "model.sliding_window=5"}, {}},
      {"qwen2: q, k and v biased, o not", {"model.preset=qwen2-tiny"}, {"model.layers.0.self_attn.v_proj.bias"}},
      {"phi3: one q|k|v projection and one gate|up, within a window of 7", {"model.preset=phi3-tiny", "model.sliding_window=7"},
       {"model.layers.0.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"}},
      {"gemma2: (1 + w) norms, four a block, GeGLU, a scaled embedding, capped scores and logits, a window of 5 on the "
       "even layers, a query scalar of 24 on 32-wide heads", {"model.preset=gemma2-tiny", "model.sliding_window=5"},
       {"model.layers.1.pre_feedforward_layernorm.weight", "model.layers.0.post_feedforward_layernorm.weight"}},
      {"gemma: (1 + w) norms, GeGLU, a scaled embedding, one kv head for four query heads, 32-wide heads on a width of 64",
       {"model.preset=gemma-tiny"}, {"model.layers.1.post_attention_layernorm.weight"}},
      {"gemma with q, k, v and o biased (attention_bias)", {"model.preset=gemma-tiny", "model.attention_bias=true"},
       {"model.layers.0.self_attn.o_proj.bias"}},
      {"gemma2 with the caps made gentle enough to matter less: caps at 2", {"model.preset=gemma2-tiny", "model.attn_logit_softcapping=2",
       "model.final_logit_softcapping=2"}, {}},
      {"qwen3: per-head q and k norms, 24-wide heads, attention_bias", {"model.preset=qwen3-tiny", "model.attention_bias=true"},
       {"model.layers.1.self_attn.k_norm.weight", "model.layers.0.self_attn.o_proj.bias"}},
  };
  return f;
}

// One micro-batch of 4 x 128 random tokens (vocabulary 512) through the model: the pool's bytes kept after its
// forward (what autograd holds for backward), and the most live at once through its backward, both above `pool`'s
// bytes before it.
struct ActivationBytes {
  double kept = 0, most = 0;
};
ActivationBytes measure_activations(LanguageModel& model, const BlockPool& pool) {
  model.set_loss_gradient(1.0);
  const torch::Tensor in = torch::randint(0, 512, {4, 128}, torch::kLong), tgt = torch::randint(0, 512, {4, 128}, torch::kLong);
  const double base = static_cast<double>(pool.stats().live_bytes);
  restart_pooled_peak();
  torch::Tensor loss = model.loss(in, tgt);
  ActivationBytes m;
  m.kept = static_cast<double>(pool.stats().live_bytes) - base;
  loss.backward();
  loss = torch::Tensor();
  m.most = static_cast<double>(pool.stats().peak_live_bytes) - base;
  return m;
}

}  // namespace

TEST(Families, EachFamilysLossAndGradientsAreHuggingFacesForwardInPlainOps) {
  for (const Family& fam : families()) {
    SCOPED_TRACE(fam.what);
    const Plan plan = test::plan_of(kConfig, 1, 0, fam.overrides);
    for (const std::string& name : fam.must_have) {
      bool found = false;
      for (const ParamSlot& s : plan.layout.params) found |= s.name == name;
      EXPECT_TRUE(found) << name;
    }
    auto device = Device::create(DeviceKind::cpu, 0);
    FlatParams flat = FlatParams::allocate(plan, 0, *device);
    torch::manual_seed(7);
    {
      torch::NoGradGuard ng;
      initialise_model(plan, flat.params, 5);
      flat.params.add_(torch::randn_like(flat.params), 0.05);  // biases and norm gains away from 0 and 1
    }
    auto model = make_model(plan, flat);
    const torch::Tensor in = torch::randint(0, 256, {2, 12}, torch::kLong), tgt = torch::randint(0, 256, {2, 12}, torch::kLong);
    expect_reference_loss_and_gradients(plan, flat, *model, in, tgt);
  }
}

TEST(Families, AWindowShorterThanTheSequenceIsCountedByThePlan) {
  // mistral-tiny attends within 64 positions; at 80 the earliest keys leave each late query's window (the
  // loss and gradients of such a window are EachFamilys...'s): the plan counts the probabilities kept and
  // the scores made while it runs.
  const Plan within = test::plan_of(kConfig, 1, 0, {"model.preset=mistral-tiny", "data.seq_len=64"});
  const Plan past = test::plan_of(kConfig, 1, 0, {"model.preset=mistral-tiny", "data.seq_len=80", "model.sliding_window=20"});
  EXPECT_FALSE(within.model.hp.attention_materialised(64));
  EXPECT_TRUE(past.model.hp.attention_materialised(80));
  const Plan none = test::plan_of(kConfig, 1, 0, {"model.preset=mistral-tiny", "data.seq_len=80", "model.sliding_window=null"});
  EXPECT_FALSE(none.model.hp.attention_materialised(80));
  const double T = 80, NH = 4, b = 4;
  EXPECT_GE(past.model.block_activation_bytes_per_token(80, 4) - none.model.block_activation_bytes_per_token(80, 4), NH * T * b);
  EXPECT_DOUBLE_EQ(past.model.attention_workspace_bytes(2, 80, 4), 2 * 2 * NH * T * T * b);
}

TEST(Families, KeysOfAnotherFamilyAreRefusedNamingThem) {
  for (const auto& [overrides, key] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"model.preset=gpt2-tiny", "model.head_dim=32"}, "model.head_dim"},
           {{"model.preset=qwen2-tiny", "model.attention_bias=true"}, "model.attention_bias"},
           {{"model.preset=qwen3-tiny", "model.mlp_bias=true"}, "model.mlp_bias"},
           {{"model.preset=llama-tiny", "model.sliding_window=32"}, "model.sliding_window"},
           {{"model.preset=llama-tiny", "model.head_dim=15"}, "model.head_dim"},
           // PEFT has no default modules for Phi-3: naming them is asked for, not guessed
           {{"model.preset=phi3-tiny", R"(model.lora={"r": 4})"}, "model.lora.target_modules"},
           // longrope is Phi-3's; Phi-3 takes no other scaling; Gemma 2 needs its window
           {{"model.preset=llama-tiny", R"(model.rope_scaling={"rope_type": "longrope", "short_factor": [1,1,1,1,1,1,1,1], "long_factor": [1,1,1,1,1,1,1,1], "original_max_position_embeddings": 8})"}, "model.rope_scaling"},
           {{"model.preset=phi3-tiny", R"(model.rope_scaling={"rope_type": "linear", "factor": 2})"}, "model.rope_scaling"},
           {{"model.preset=gemma2-tiny", "model.sliding_window=null"}, "model.sliding_window"}}) {
    SCOPED_TRACE(key);
    try {
      test::plan_of(kConfig, 1, 0, overrides);
      ADD_FAILURE() << "planned";
    } catch (const ConfigError& e) {
      EXPECT_NE(test::find_issue(e.issues(), key), nullptr) << test::dump(e.issues());
    }
  }
}

TEST(Families, TheFinalCapsLossAndGradientsInFp32AndBf16TrackTheDoubleReference) {
  // Gemma 2's final_logit_softcapping inside the fused head, with logits bent by the cap (past 1.5 cap), in fp32
  // and in bf16 (where the gradients' own rounding, about 3e-3 of the largest here, is what remains). The
  // reference in double from the same rounded inputs.
  torch::manual_seed(5);
  const double cap = 3.0;
  const torch::Tensor x0 = torch::randn({24, 16}, torch::kFloat64) * 0.6, w0 = torch::randn({40, 16}, torch::kFloat64);
  const torch::Tensor t = torch::randint(0, 40, {24}, torch::kLong);
  for (const auto& [dtype, loss_tol, grad_tol] : {std::tuple{torch::kFloat32, 1e-6, 1e-5}, std::tuple{torch::kBFloat16, 1e-2, 1e-2}}) {
    SCOPED_TRACE(dtype == torch::kFloat32 ? "fp32" : "bf16");
    const torch::Tensor xr = x0.to(dtype).to(torch::kFloat64).requires_grad_(true), wr = w0.to(dtype).to(torch::kFloat64).requires_grad_(true);
    const torch::Tensor logits = torch::matmul(xr, wr.t());
    ASSERT_GT(logits.abs().max().item<double>(), 1.5 * cap);  // the cap bends them
    const torch::Tensor want = torch::cross_entropy_loss(torch::tanh(logits / cap) * cap, t);
    want.backward();
    const torch::Tensor x = x0.to(dtype).requires_grad_(true), w = w0.to(dtype).requires_grad_(true);
    const torch::Tensor got = fused_head_loss(x, w, t, 1.0, kHeadChunkElements, nullptr, cap);
    got.backward();
    EXPECT_NEAR(got.item<double>(), want.item<double>(), loss_tol * want.item<double>());
    for (const auto& [mine, theirs] : {std::pair{x.grad(), xr.grad()}, std::pair{w.grad(), wr.grad()}}) {
      const double scale = theirs.abs().max().item<double>();
      EXPECT_LT((mine.to(torch::kFloat64) - theirs).abs().max().item<double>() / scale, grad_tol);
    }
    // Without the cap the same inputs give another loss: the cap acted.
    EXPECT_GT(std::fabs(fused_head_loss(x.detach(), w.detach(), t, 1.0).item<double>() - got.item<double>()), 1e-3);
  }
}

// Fine-tuning data's masks: a target of -1 (padding, a prompt's token) is not counted. The loss is the mean
// over the counted targets and the gradients are those of that mean, as torch's cross-entropy with an
// ignore_index gives them; a micro batch with nothing counted contributes a zero loss and zero gradients.
TEST(Families, MaskedTargetsAreLeftOutOfTheLossAndItsGradients) {
  const Plan plan = test::plan_of(kConfig, 1, 0, families()[3].overrides);
  auto device = Device::create(DeviceKind::cpu, 0);
  FlatParams flat = FlatParams::allocate(plan, 0, *device);
  torch::manual_seed(11);
  {
    torch::NoGradGuard ng;
    initialise_model(plan, flat.params, 5);
  }
  auto model = make_model(plan, flat);
  const torch::Tensor in = torch::randint(0, 256, {2, 12}, torch::kLong);
  torch::Tensor tgt = torch::randint(0, 256, {2, 12}, torch::kLong);
  tgt.narrow(1, 0, 5).fill_(-1);               // the prompts of both rows
  tgt[1].narrow(0, 9, 3).fill_(-1);            // and the second row's padding
  const double loss = expect_reference_loss_and_gradients(plan, flat, *model, in, tgt);
  // Any negative target is masked alike.
  torch::Tensor other = tgt.clone();
  other[0][0] = -7;
  other[1][10] = -100;
  {
    torch::NoGradGuard ng;
    EXPECT_EQ(model->loss(in, other).item<double>(), loss);
  }
  flat.grads.zero_();
  const torch::Tensor none = model->loss(in, torch::full({2, 12}, -1, torch::kLong));
  none.backward();
  EXPECT_EQ(none.item<double>(), 0.0);
  EXPECT_EQ(flat.grads.abs().max().item<double>(), 0.0);
}

// What autograd keeps from a micro batch's forward to its backward, and the most that is live while the
// two run, measured in ds's block pool (every tensor of 64 KiB and more: at these widths all the
// per-token ones), against the plan's activation model: per family, in fp32 and bf16.
TEST(Families, TheActivationsEachFamilyKeepsAreWhatThePlanCounts) {
  const BlockPool& pool = route_large_tensors_to_pool();
  const std::vector<std::string> widths = {"model.hidden_size=128", "model.num_heads=4", "model.intermediate_size=352",
                                           "model.vocab_size=512", "model.max_position_embeddings=128", "data.seq_len=128",
                                           "train_micro_batch_size_per_gpu=4"};
  const std::vector<std::string> rotary = {"model.num_kv_heads=2", "model.head_dim=32"};
  const std::vector<std::vector<std::string>> families = {
      {"model.preset=gpt2-tiny"},
      {"model.preset=llama-tiny", "model.attention_bias=true"},
      {"model.preset=mistral-tiny", "model.sliding_window=32"},
      {"model.preset=qwen2-tiny"},
      {"model.preset=qwen3-tiny"},
      {"model.preset=phi3-tiny", "model.sliding_window=48"},
      {"model.preset=phi3-tiny", "model.sliding_window=null"},  // the fused attention over the fused projection's v
      {"model.preset=gemma-tiny"},
      {"model.preset=gemma2-tiny", "model.sliding_window=32"},
      {"model.preset=gemma2-tiny", "model.sliding_window=128", "model.attn_logit_softcapping=null", "model.final_logit_softcapping=null", "model.query_pre_attn_scalar=32"}};
  for (const auto& family : families) {
    for (const auto& [bf16, layers] : {std::pair{false, 2}, std::pair{true, 2}, std::pair{false, 8}, std::pair{true, 8}}) {
      std::vector<std::string> overrides = family;
      overrides.push_back("model.num_layers=" + std::to_string(layers));  // the blocks' share of the count, and the rest's
      overrides.insert(overrides.end(), widths.begin(), widths.end());
      if (family[0] != "model.preset=gpt2-tiny") overrides.insert(overrides.end(), rotary.begin(), rotary.end());
      overrides.push_back(std::string("bf16.enabled=") + (bf16 ? "true" : "false"));
      const Plan plan = test::plan_of(kConfig, 1, 0, overrides);
      SCOPED_TRACE(family[0] + (family.size() > 1 ? " " + family[1] : "") + (bf16 ? " bf16 " : " fp32 ") + std::to_string(layers) + " blocks");
      auto device = Device::create(DeviceKind::cpu, 0);
      FlatParams flat = FlatParams::allocate(plan, 0, *device);
      {
        torch::NoGradGuard ng;
        torch::Tensor init = torch::zeros({plan.layout.numel}, torch::kFloat32);
        initialise_model(plan, init, 5);
        flat.params.copy_(init);
      }
      auto model = make_model(plan, flat);
      const int64_t B = 4, T = 128;
      const auto [kept, most] = measure_activations(*model, pool);
      // (On a CPU without AVX-512 ds takes bf16 products in fp32, matmul.cpp: LibTorch 1.13's own accumulate in bf16
      // there; the plan counts their operands' fp32 copies where the machine it plans for is such a CPU.)
      const bool widened_products = bf16 && !cpu_has_avx512();
      const ActivationParts planned = activation_parts(plan.model, B, T, plan.precision.compute_dtype, false, plan.threads, 0, false, widened_products);
      // Kept after forward: what autograd holds, and the head's chunk of logits (here all 512 rows of the 512-word
      // vocabulary in the compute dtype) that the model keeps for later steps.
      const double chunk = 512.0 * 512 * dtype_bytes(plan.precision.compute_dtype);
      ASSERT_GE(head_chunk_rows(512), B * T);
      EXPECT_GT(kept / (planned.kept + chunk), 0.97) << kept << " bytes kept";
      EXPECT_LT(kept / (planned.kept + chunk), 1.02) << kept << " bytes kept";
      // The most live at any moment, transients included: never above the plan's count; below it where the
      // plan counts the larger of two attention paths the CPU chooses between, or the materialised
      // attention's scores whole beside every kept activation.
      EXPECT_LT(most, 1.01 * planned.total());
      EXPECT_GT(most, 0.6 * planned.total());
      std::printf("%-52s %s %d blocks: kept %.2f MiB = %.3fx the plan's, most %.2f MiB = %.3fx\n",
                  (family[0] + (family.size() > 1 ? " " + family[1] : "")).c_str(), bf16 ? "bf16" : "fp32", layers, kept / 1048576,
                  kept / (planned.kept + chunk), most / 1048576, most / planned.total());
    }
  }
}

// Blocks below every trained tensor run forward only, and recomputed blocks (in groups of
// pipeline.activation_checkpoint_interval) keep only each group's input: the activations kept are what the plan
// counts (activation_parts' recompute_group and forward_only), and a backward still trains what is above.
TEST(Families, BlocksRunningForwardOnlyOrRecomputedInGroupsKeepWhatThePlanCounts) {
  const BlockPool& pool = route_large_tensors_to_pool();
  const std::vector<std::string> widths = {"model.hidden_size=128", "model.num_heads=4", "model.intermediate_size=352", "model.vocab_size=512",
                                           "model.max_position_embeddings=128", "data.seq_len=128", "train_micro_batch_size_per_gpu=4",
                                           "model.num_layers=8", "bf16.enabled=false"};
  const std::string gpt2_frozen = R"(model.freeze=["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.[0-4].*"])";
  const std::string llama_frozen = R"(model.freeze=["model.embed_tokens.weight", "model.layers.[0-4].*"])";
  struct Case {
    std::vector<std::string> overrides;
    int64_t backward_from, group;  // group 0: nothing recomputed
  };
  for (const Case& c : {Case{{"model.preset=gpt2-tiny", gpt2_frozen}, 5, 0},
                        Case{{"model.preset=llama-tiny", "model.num_kv_heads=2", "model.head_dim=32", llama_frozen}, 5, 0},
                        Case{{"model.preset=llama-tiny", "model.num_kv_heads=2", "model.head_dim=32", "pipeline.activation_checkpoint_interval=3"}, 0, 3},
                        Case{{"model.preset=gpt2-tiny", "model.activation_checkpointing=true"}, 0, 1},
                        Case{{"model.preset=gpt2-tiny", gpt2_frozen, "pipeline.activation_checkpoint_interval=2"}, 5, 2},
                        Case{{"model.preset=gpt2-tiny", R"(model.freeze=["transformer.wte.weight", "transformer.wpe.weight", "transformer.h.*"])"}, 8, 0}}) {
    std::string what;
    for (const std::string& o : c.overrides) what += o + " ";
    SCOPED_TRACE(what);
    std::vector<std::string> overrides = c.overrides;
    overrides.insert(overrides.end(), widths.begin(), widths.end());
    const Plan plan = test::plan_of(kConfig, 1, 0, overrides);
    ASSERT_EQ(plan.backward_from, c.backward_from);
    ASSERT_EQ(plan.activation_checkpointing ? plan.recompute_group : 0, c.group);
    auto device = Device::create(DeviceKind::cpu, 0);
    FlatParams flat = FlatParams::allocate(plan, 0, *device);
    {
      torch::NoGradGuard ng;
      flat.params.normal_(0.0, 0.02);
      if (flat.frozen.defined()) flat.frozen.normal_(0.0, 0.02);
    }
    auto model = make_model(plan, flat);
    const int64_t B = 4, T = 128;
    const auto [kept, most] = measure_activations(*model, pool);
    const bool widened_products = plan.precision.compute_dtype == Dtype::bf16 && !cpu_has_avx512();  // (as above)
    const ActivationParts planned =
        activation_parts(plan.model, B, T, plan.precision.compute_dtype, c.group, plan.threads, plan.backward_from, false, widened_products);
    const ActivationParts every = activation_parts(plan.model, B, T, plan.precision.compute_dtype, 0, plan.threads);
    const double chunk = 512.0 * 512 * dtype_bytes(plan.precision.compute_dtype);  // the head's kept chunk of logits
    EXPECT_GT(kept / (planned.kept + chunk), 0.97) << kept << " bytes kept";
    EXPECT_LT(kept / (planned.kept + chunk), 1.02) << kept << " bytes kept";
    EXPECT_LT(planned.kept, 0.5 * every.kept);
    EXPECT_GT(flat.grads.abs().sum().item<double>(), 0.0);
    EXPECT_LT(most, 1.01 * planned.total());  // the most live at once, transients included
    std::printf("%-64s kept %.2f MiB = %.3fx the plan's (keeping every block's: %.2f MiB), most %.3fx\n", what.c_str(), kept / 1048576,
                kept / (planned.kept + chunk), (every.kept + chunk) / 1048576, most / planned.total());
  }
}
