"""Named configurations, each with a note on where it comes from (see SPEC.md §2 for counts)."""

from __future__ import annotations

from spec.config import GatedDeltaNet, MixtureOfExperts, ModelConfig, RopeScaling
from spec.errors import ConfigError

_PRESETS: dict[str, tuple[str, ModelConfig]] = {
    "tiny": (
        "Small paper-style model for demos and CI: post-LN, sinusoidal, sqrt(d) scale, ReLU, "
        "all biases; distinct source/target vocabularies so a swapped table shows up; tied head; "
        "the paper's dropout 0.1 and label smoothing 0.1 for the training cells.",
        ModelConfig(
            d_model=64, n_heads=4, d_ff=256, n_encoder_layers=2, n_decoder_layers=2,
            src_vocab_size=96, tgt_vocab_size=80, max_len=64, tie_head=True, dropout=0.1, label_smoothing=0.1,
        ),
    ),
    "paper-base": (
        "Vaswani et al. 2017, Table 3 'base': d 512, 8 heads, d_ff 2048, 6+6 layers, shared "
        "37000-token BPE vocabulary, embeddings shared with the pre-softmax linear, post-LN, "
        "sinusoidal positions, embeddings x sqrt(d_model), ReLU, dropout 0.1, label smoothing 0.1.",
        ModelConfig(
            d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6,
            src_vocab_size=37000, tgt_vocab_size=37000, max_len=1024,
            share_src_tgt_embed=True, tie_head=True, dropout=0.1, label_smoothing=0.1,
        ),
    ),
    "paper-big": (
        "Vaswani et al. 2017, Table 3 'big': d 1024, 16 heads, d_ff 4096, 6+6 layers, otherwise "
        "as paper-base (dropout 0.3 as in the table's EN-DE big model).",
        ModelConfig(
            d_model=1024, n_heads=16, d_ff=4096, n_encoder_layers=6, n_decoder_layers=6,
            src_vocab_size=37000, tgt_vocab_size=37000, max_len=1024,
            share_src_tgt_embed=True, tie_head=True, dropout=0.3, label_smoothing=0.1,
        ),
    ),
    "torch-nn": (
        "Exactly torch.nn.Transformer's defaults (d 512, 8 heads, 6+6 layers, d_ff 2048, post-LN, "
        "LayerNorm eps 1e-5, a final norm on both stacks, ReLU, every Linear with a bias), "
        "wrapped as the PyTorch tutorials do: token embeddings x sqrt(d), interleaved sinusoidal "
        "positions and an untied output Linear with a bias.",
        ModelConfig(
            d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6,
            src_vocab_size=1000, tgt_vocab_size=1000, max_len=512, norm_eps=1e-5,
            final_norm=True, head_bias=True, dropout=0.1,
        ),
    ),
    "annotated": (
        "The Annotated Transformer's tutorial variant: post-LN with norm='std' "
        "(a*(x-mean)/(std+eps)+b, unbiased std), eps 1e-6, no q/k/v bias, d 512, 8 heads, 8+8 "
        "layers, d_ff 2048, vocabularies 1024/1024, max_len 2048, untied head with a bias, no "
        "final norm. Each encoder layer has 3,150,848 parameters.",
        ModelConfig(
            d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=8, n_decoder_layers=8,
            src_vocab_size=1024, tgt_vocab_size=1024, max_len=2048, norm="std",
            qkv_bias=False, head_bias=True, dropout=0.1,
        ),
    ),
    "learned-pos": (
        "Learned position embeddings instead of sinusoids and no sqrt(d) embedding scale (as "
        "BERT/BART-style models do): d 256, 8 heads, 6+6 layers, d_ff 1024, max_len 128, exact "
        "GELU, one shared 512-token vocabulary tied to the head.",
        ModelConfig(
            d_model=256, n_heads=8, d_ff=1024, n_encoder_layers=6, n_decoder_layers=6,
            src_vocab_size=512, tgt_vocab_size=512, max_len=128, positional="learned",
            embed_scale=False, activation="gelu", share_src_tgt_embed=True, tie_head=True,
        ),
    ),
    "char-lm": (
        "A small GPT-style character language model: decoder-only, pre-LN with a final norm, "
        "learned positions, no embedding scale, tanh-approximated GELU, byte vocabulary (256), "
        "tied head; d 128, 4 heads, 4 layers, d_ff 512, max_len 256, dropout 0.1.",
        ModelConfig(
            arch="decoder-only", d_model=128, n_heads=4, d_ff=512, n_decoder_layers=4,
            tgt_vocab_size=256, max_len=256, norm_position="pre", norm_eps=1e-5, final_norm=True,
            positional="learned", embed_scale=False, activation="gelu-tanh", tie_head=True, dropout=0.1,
        ),
    ),
    "llama-tiny": (
        "A Llama-family decoder at odd sizes (SmolLM2's and Llama 3.2's layout): pre-RMSNorm "
        "(eps 1e-5) with a final norm, rotary positions (theta 500000, Llama 3's), SwiGLU FFN, no "
        "biases anywhere, no embedding scale, untied head; d 48, 6 heads of 8, grouped-query "
        "attention with 3 key/value heads (2 groups), d_ff 88, 2 layers, vocabulary 97.",
        ModelConfig(
            arch="decoder-only", d_model=48, n_heads=6, n_kv_heads=3, d_ff=88, n_decoder_layers=2,
            tgt_vocab_size=97, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-5,
            final_norm=True, positional="rope", rope_theta=500000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=False, bias=False,
        ),
    ),
    "qwen2-tiny": (
        "A Qwen2/Qwen2.5-family decoder at odd sizes: as llama-tiny, with biases on q, k and v "
        "but not on o nor the FFN, rope theta 1000000, eps 1e-6, multi-query attention (1 "
        "key/value head for 4 query heads of 10), d 40, d_ff 72, 2 layers, vocabulary 101, tied head.",
        ModelConfig(
            arch="decoder-only", d_model=40, n_heads=4, n_kv_heads=1, d_ff=72, n_decoder_layers=2,
            tgt_vocab_size=101, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6,
            final_norm=True, positional="rope", rope_theta=1000000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=True, bias=False, tie_head=True,
        ),
    ),
    "qwen3-tiny": (
        "A Qwen3-family decoder at odd sizes: as qwen2-tiny without the q/k/v biases, with an "
        "RMSNorm of each head's q and k before the rotation, and head_dim decoupled from "
        "d_model / n_heads (Qwen3-0.6B: d 1024, 16 heads of 128): d 36, 4 heads of 12, 2 "
        "key/value heads, d_ff 60, 2 layers, vocabulary 89, untied head. Its eps is 1e-5, not "
        "Qwen3's 1e-6, so that a port with Qwen3's eps written into its norms fails.",
        ModelConfig(
            arch="decoder-only", d_model=36, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=60, n_decoder_layers=2,
            tgt_vocab_size=89, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-5,
            final_norm=True, positional="rope", rope_theta=1000000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qk_norm=True, qkv_bias=False, bias=False,
        ),
    ),
    "stablelm-tiny": (
        "A StableLM-2-family decoder at odd sizes (stablelm-2-1_6b's layout, GPT-NeoX's partial "
        "rotary): pre-LayerNorm with biases (eps 1e-5) and a final norm, rotary positions on the "
        "first quarter of each head's dimensions (theta 10000), SwiGLU FFN, biases on q, k and v "
        "only, multi-head attention, no embedding scale, untied head; d 48, 3 heads of 16 (4 "
        "rotate), d_ff 80, 2 layers, vocabulary 103.",
        ModelConfig(
            arch="decoder-only", d_model=48, n_heads=3, d_ff=80, n_decoder_layers=2, tgt_vocab_size=103,
            max_len=2048, norm_position="pre", norm="layernorm", norm_eps=1e-5, final_norm=True,
            positional="rope", rope_fraction=0.25, embed_scale=False, activation="swish", gated_ffn=True,
            qkv_bias=True, bias=False,
        ),
    ),
    "llama3-tiny": (
        "A Llama 3.1/3.2-family decoder at odd sizes, with Llama 3's rescaled rotary frequencies "
        "(rope_type llama3: factor 32, low_freq_factor 1, high_freq_factor 4, as Llama 3.2; the "
        "original context 1280 rather than 8192, so that the tiny head's six frequencies fall in all "
        "three bands: two kept, one blended half and half, three divided by the factor): d 48, 4 heads of 12, 2 "
        "key/value heads, d_ff 88, 2 layers, vocabulary 109, theta 500000, eps 1e-5, tied head.",
        ModelConfig(
            arch="decoder-only", d_model=48, n_heads=4, n_kv_heads=2, d_ff=88, n_decoder_layers=2,
            tgt_vocab_size=109, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-5,
            final_norm=True, positional="rope", rope_theta=500000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=False, bias=False, tie_head=True,
            rope_scaling=RopeScaling(kind="llama3", factor=32.0, original_max_len=1280, low_freq_factor=1.0,
                                     high_freq_factor=4.0),
        ),
    ),
    "qwen2-yarn-tiny": (
        "A Qwen2.5-family decoder at odd sizes with YaRN (rope_type yarn, factor 4, as Qwen2.5's "
        "long-context configs; the original context 4096, so that of the head's five frequency pairs "
        "two are kept, one is half interpolated and two are interpolated; the temperature "
        "0.1 ln 4 + 1 on cos and sin): as qwen2-tiny with 2 key/value heads, d 40, 4 heads of 10, "
        "d_ff 72, 2 layers, vocabulary 113, theta 1000000, max_len 16384.",
        ModelConfig(
            arch="decoder-only", d_model=40, n_heads=4, n_kv_heads=2, d_ff=72, n_decoder_layers=2,
            tgt_vocab_size=113, max_len=16384, norm_position="pre", norm="rmsnorm", norm_eps=1e-6,
            final_norm=True, positional="rope", rope_theta=1000000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=True, bias=False, tie_head=True,
            rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_len=4096),
        ),
    ),
    "mistral-tiny": (
        "A Mistral-family decoder at odd sizes with a sliding window of 4 keys (Mistral 7B v0.1's is "
        "4096; 4 is shorter than every case's sequence but single_token's, so those cases have queries "
        "that see fewer keys than plain causal attention would give them): d 56, 4 heads of 14, 2 key/value heads, d_ff 96, "
        "2 layers, vocabulary 107, theta 1000000, eps 1e-5, no biases, untied head.",
        ModelConfig(
            arch="decoder-only", d_model=56, n_heads=4, n_kv_heads=2, d_ff=96, n_decoder_layers=2,
            tgt_vocab_size=107, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-5,
            final_norm=True, positional="rope", rope_theta=1000000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=False, bias=False, tie_head=False, sliding_window=4,
        ),
    ),
    "phi3-tiny": (
        "A Phi-3.5/Phi-4-mini-family decoder at odd sizes with LongRoPE (rope_type longrope: a short "
        "and a long factor per rotated pair, the long ones for a call longer than the original context; "
        "attention factor sqrt(1 + ln 4 / ln 1002) from factor 4) and Phi-4-mini's partial rotary "
        "(three quarters of each head: 12 of 16 dimensions, 6 pairs). The original context is 1002, "
        "so that decode-far's prefill of 1001 positions and its first step (1002) take the short "
        "factors and its second step (1003) the long ones, mha-far the long ones, forward-long (520) and "
        "every short case the short ones: d 80, 5 heads of 16, 1 key/value head, d_ff 76, 2 layers, "
        "vocabulary 127, theta 10000, eps 1e-5, no biases, untied head, max_len 4096.",
        ModelConfig(
            arch="decoder-only", d_model=80, n_heads=5, n_kv_heads=1, d_ff=76, n_decoder_layers=2,
            tgt_vocab_size=127, max_len=4096, norm_position="pre", norm="rmsnorm", norm_eps=1e-5,
            final_norm=True, positional="rope", rope_fraction=0.75, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=False, bias=False, tie_head=False,
            rope_scaling=RopeScaling(kind="longrope", factor=4.0, original_max_len=1002,
                                     short_factor=(1.0, 1.02, 1.11, 1.37, 1.9, 2.6),
                                     long_factor=(1.08, 1.3, 3.2, 9.7, 22.0, 41.5)),
        ),
    ),
    "gemma2-tiny": (
        "A Gemma 2-family decoder at odd sizes: RMSNorm multiplying by (1 + scale) with four norms a "
        "layer (before and after attention and the FFN), the embeddings times sqrt(d), GeGLU (tanh "
        "GELU), scores scaled by 1/sqrt(query_pre_attention_scalar) = 1/sqrt(16) rather than "
        "1/sqrt(head_dim 20) (Gemma 2 27B's differ too), attention scores capped by 4 tanh(x / 4) "
        "and the logits by 4 tanh(x / 4) (Gemma 2's 50 and 30, lowered so that the conformance weights' "
        "scores and logits bend at every dtype), layers alternating sliding (window 4) and full "
        "attention as Gemma 2's: d 72, 4 heads of 20, 2 key/value heads, d_ff 112, 2 layers, "
        "vocabulary 131, theta 10000, eps 1e-6, tied head.",
        ModelConfig(
            arch="decoder-only", d_model=72, n_heads=4, n_kv_heads=2, head_dim=20, d_ff=112, n_decoder_layers=2,
            tgt_vocab_size=131, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6,
            final_norm=True, positional="rope", rope_theta=10000.0, embed_scale=True, activation="gelu-tanh",
            gated_ffn=True, qkv_bias=False, bias=False, tie_head=True, sliding_window=4,
            layer_types=("sliding", "full"), norm_scale_plus_one=True, post_norms=True,
            query_pre_attention_scalar=16.0, attention_softcap=4.0, final_softcap=4.0,
        ),
    ),
    "gemma3-tiny": (
        "A Gemma 3-family text decoder at odd sizes: Gemma 2's layer without the softcaps, with an "
        "RMSNorm (1 + scale) of each head's q and k, two sliding layers (window 4) then a full one "
        "(Gemma 3's five to one, shortened), the sliding layers rotating by their own theta 10000 "
        "unrescaled and the full one by theta 1000000 with linear scaling by 8 (Gemma 3 4B's): "
        "d 60, 4 heads of 16, 1 key/value head, query_pre_attention_scalar 16, d_ff 100, 3 layers, "
        "vocabulary 139, eps 1e-6, tied head.",
        ModelConfig(
            arch="decoder-only", d_model=60, n_heads=4, n_kv_heads=1, head_dim=16, d_ff=100, n_decoder_layers=3,
            tgt_vocab_size=139, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6,
            final_norm=True, positional="rope", rope_theta=1000000.0, embed_scale=True, activation="gelu-tanh",
            gated_ffn=True, qkv_bias=False, bias=False, tie_head=True, qk_norm=True, sliding_window=4,
            layer_types=("sliding", "sliding", "full"), local_rope_theta=10000.0,
            rope_scaling=RopeScaling(kind="linear", factor=8.0), norm_scale_plus_one=True, post_norms=True,
            query_pre_attention_scalar=16.0,
        ),
    ),
    "mixtral-tiny": (
        "A Mixtral-family decoder at odd sizes: llama-tiny's layer (pre-RMSNorm eps 1e-5, rotary "
        "positions with Mixtral's theta 1000000, grouped-query attention, no biases, untied head) whose "
        "FFN is a mixture of 5 SwiGLU experts of width 36, 2 chosen per token, their weights "
        "renormalised over the 2, the router's softmax in float32, trained with Mixtral's load-balancing "
        "loss at its published weight 0.02: d 40, 4 heads of 10 over 2 key/value heads, 2 layers, "
        "vocabulary 83.",
        ModelConfig(
            arch="decoder-only", d_model=40, n_heads=4, n_kv_heads=2, d_ff=36, n_decoder_layers=2,
            tgt_vocab_size=83, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-5,
            final_norm=True, positional="rope", rope_theta=1000000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=False, bias=False,
            moe=MixtureOfExperts(n_experts=5, experts_per_token=2, load_balancing=0.02),
        ),
    ),
    "qwen3-moe-tiny": (
        "A Qwen3-MoE-family decoder at odd sizes: qwen3-tiny's layer (q/k head norms, head_dim 12 "
        "apart from d / heads, eps 1e-6, theta 1000000, untied head) whose FFN is a mixture of 6 SwiGLU "
        "experts of width 28 (moe_intermediate_size), 2 chosen per token, their weights the router's "
        "probabilities as they are (norm_topk_prob false): d 36, 4 heads of 12 over 2 key/value "
        "heads, 2 layers, vocabulary 91.",
        ModelConfig(
            arch="decoder-only", d_model=36, n_heads=4, n_kv_heads=2, head_dim=12, d_ff=28, n_decoder_layers=2,
            tgt_vocab_size=91, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6,
            final_norm=True, positional="rope", rope_theta=1000000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qk_norm=True, qkv_bias=False, bias=False,
            moe=MixtureOfExperts(n_experts=6, experts_per_token=2, renormalize=False),
        ),
    ),
    "qwen35-tiny": (
        "A Qwen3.5-family hybrid at odd sizes (SPEC §5.15): three gated DeltaNet layers, then a gated "
        "full-attention one (q/k head norms, a quarter of each head rotated, theta 1e7), zero-centred "
        "(1 + w) norms, eps 1e-6, SwiGLU, tied head. Its linear layers: 2 key heads of 8, 4 value heads "
        "of 6 (two per key head), a convolution 3 wide, chunks of 5, so the catalogue's 6-token cases "
        "already cross a chunk: d 40, 4 heads of 16 over 2 key/value heads, d_ff 56, vocabulary 97.",
        ModelConfig(
            arch="decoder-only", d_model=40, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=56, n_decoder_layers=4,
            tgt_vocab_size=97, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6, final_norm=True,
            positional="rope", rope_theta=10000000.0, rope_fraction=0.25, embed_scale=False, activation="swish",
            gated_ffn=True, qk_norm=True, qkv_bias=False, bias=False, norm_scale_plus_one=True,
            tie_head=True, attention_output_gate=True, layer_types=("linear", "linear", "linear", "full"),
            linear_attention=GatedDeltaNet(key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=6,
                                           conv_kernel=3, chunk_size=5),
        ),
    ),
    "qwen3-next-tiny": (
        "A Qwen3-Next-family hybrid at odd sizes (SPEC §5.14, §5.15): qwen35-tiny's layout (three gated "
        "DeltaNet layers, then a gated full-attention one with q/k head norms and a quarter of each head "
        "rotated; (1 + w) norms, eps 1e-6) whose every FFN is a mixture of 5 SwiGLU experts of width 20, "
        "2 chosen per token and renormalised (norm_topk_prob), beside a shared expert of width 24 gated "
        "by a sigmoid; untied head. Its linear layers: 2 key heads of 6, 6 value heads of 5 (three per "
        "key head), a convolution 4 wide, chunks of 4: d 44, 4 heads of 16 over 2 key/value heads, theta "
        "1000000, vocabulary 89.",
        ModelConfig(
            arch="decoder-only", d_model=44, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=20, n_decoder_layers=4,
            tgt_vocab_size=89, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6, final_norm=True,
            positional="rope", rope_theta=1000000.0, rope_fraction=0.25, embed_scale=False, activation="swish",
            gated_ffn=True, qk_norm=True, qkv_bias=False, bias=False, norm_scale_plus_one=True,
            tie_head=False, attention_output_gate=True, layer_types=("linear", "linear", "linear", "full"),
            linear_attention=GatedDeltaNet(key_heads=2, value_heads=6, key_head_dim=6, value_head_dim=5,
                                           conv_kernel=4, chunk_size=4),
            moe=MixtureOfExperts(n_experts=5, experts_per_token=2, renormalize=True, shared_expert_d_ff=24),
        ),
    ),
    "smollm3-tiny": (
        "A SmolLM3-family decoder at odd sizes: Llama's layer (pre-RMSNorm, SwiGLU, grouped-query "
        "attention, no biases) in which some layers rotate nothing (NoPE, SPEC §5.11): layers 1 and 3 of "
        "4 (SmolLM3 leaves out every fourth, from its fourth; here every second, so that a port that "
        "places them by SmolLM3's default interval fails on layer 1), theta 5000000 (SmolLM3-3B's), eps "
        "1e-6, tied head: d 56, 4 heads of 14 over 2 key/value heads, d_ff 96, vocabulary 107.",
        ModelConfig(
            arch="decoder-only", d_model=56, n_heads=4, n_kv_heads=2, d_ff=96, n_decoder_layers=4,
            tgt_vocab_size=107, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6,
            final_norm=True, positional="rope", rope_theta=5000000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=False, bias=False, tie_head=True, nope_layers=(1, 3),
        ),
    ),
    "olmo2-tiny": (
        "An OLMo 2-family decoder at odd sizes: each sublayer's output normed before the residual sum and no "
        "norm before it (norm_position 'output', SPEC §5.7), q and k each normed by one RMSNorm over the "
        "whole projection, all heads at once (qk_norm_scope 'projection', SPEC §5.11), SwiGLU, no biases, "
        "theta 500000, eps 1e-6 (OLMo 2 1B's; its config class defaults to 1e-5), untied: d 52, 4 heads of 16 "
        "over 2 key/value heads (so q's norm is 64 wide and k's 32), d_ff 92, 3 layers, vocabulary 79.",
        ModelConfig(
            arch="decoder-only", d_model=52, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=92, n_decoder_layers=3,
            tgt_vocab_size=79, max_len=4096, norm_position="output", norm="rmsnorm", norm_eps=1e-6,
            final_norm=True, positional="rope", rope_theta=500000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=False, bias=False, qk_norm=True, qk_norm_scope="projection",
        ),
    ),
    "gpt-oss-tiny": (
        "A gpt-oss-family decoder at odd sizes (SPEC §5.16): biases on q, k, v and o, a learned sink per head in "
        "the softmax's denominator, layers sliding (a window of 4 keys; gpt-oss's is 128) then full, YaRN "
        "untruncated (factor 8 over an original context of 1024, theta 50000, so that the ramp's ends fall "
        "between dimensions and truncating them moves a frequency), eps 1e-5; in every layer a mixture of 6 "
        "experts with biases, 3 per token weighed by a softmax over their logits alone in the logits' dtype, "
        "the router's logits with a bias, the experts' clamped SwiGLU with limit 3 and gain 1.5 (gpt-oss's 7 "
        "and 1.702; at these weights 3 clamps 13-21% of the gates and 1% of the linear units), untied: d 44, "
        "4 heads of 14 over 2 key/value heads, d_ff 20 per expert, 2 layers, vocabulary 73.",
        ModelConfig(
            arch="decoder-only", d_model=44, n_heads=4, n_kv_heads=2, head_dim=14, d_ff=20, n_decoder_layers=2,
            tgt_vocab_size=73, max_len=8192, norm_position="pre", norm="rmsnorm", norm_eps=1e-5,
            final_norm=True, positional="rope", rope_theta=50000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=True, bias=True, sliding_window=4, layer_types=("sliding", "full"),
            rope_scaling=RopeScaling(kind="yarn", factor=8.0, original_max_len=1024, truncate=False),
            attention_sinks=True, swiglu_limit=3.0, swiglu_alpha=1.5,
            moe=MixtureOfExperts(n_experts=6, experts_per_token=3, router_softmax="activation", router_bias=True),
        ),
    ),
    "gemma2-small": (
        "A Gemma 2-family decoder of llama-small's size, for the CPU bench against onnxruntime-genai and "
        "CTranslate2: Gemma 2's layer (four (1 + scale) RMSNorms, GeGLU, the embeddings times sqrt(d) = 24 "
        "exactly, which onnxruntime-genai's two-decimal rounding keeps), its own softcaps 50 on the scores "
        "and 30 on the logits, query_pre_attention_scalar 64 = head_dim (Gemma 2 2B's and 9B's equal "
        "theirs too), layers alternating sliding (window 32, which the bench's 16-token prompt and 64 new "
        "tokens cross) and full: d 576, 9 heads of 64 over 3 key/value heads, d_ff 1536, 10 layers, "
        "vocabulary 49152, theta 10000, eps 1e-6, tied head, max_len 2048.",
        ModelConfig(
            arch="decoder-only", d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, n_decoder_layers=10,
            tgt_vocab_size=49152, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6,
            final_norm=True, positional="rope", rope_theta=10000.0, embed_scale=True, activation="gelu-tanh",
            gated_ffn=True, qkv_bias=False, bias=False, tie_head=True, sliding_window=32,
            layer_types=("sliding", "full") * 5, norm_scale_plus_one=True, post_norms=True,
            query_pre_attention_scalar=64.0, attention_softcap=50.0, final_softcap=30.0,
        ),
    ),
    "qwen35-small": (
        "Qwen3.5's hybrid at llama-small's width, for the CPU bench of the recurrent state: 8 layers, each "
        "fourth a gated full-attention one (q/k head norms, a quarter of each head rotated, theta 1e7), the "
        "others gated DeltaNet with 3 key heads of 64 and 6 value heads of 64 (two per key head), a "
        "convolution 4 wide and chunks of 64 as the checkpoints have them; (1 + w) norms, eps 1e-6, SwiGLU: "
        "d 576, 9 heads of 64 over 3 key/value heads, d_ff 1536, vocabulary 49152, tied head, max_len 2048.",
        ModelConfig(
            arch="decoder-only", d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536, n_decoder_layers=8,
            tgt_vocab_size=49152, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-6, final_norm=True,
            positional="rope", rope_theta=10000000.0, rope_fraction=0.25, embed_scale=False, activation="swish",
            gated_ffn=True, qk_norm=True, qkv_bias=False, bias=False, norm_scale_plus_one=True,
            tie_head=True, attention_output_gate=True, layer_types=("linear", "linear", "linear", "full") * 2,
            linear_attention=GatedDeltaNet(key_heads=3, value_heads=6, key_head_dim=64, value_head_dim=64,
                                           conv_kernel=4, chunk_size=64),
        ),
    ),
    "llama-small": (
        "SmolLM2-135M's shape at a third of its depth, for the CPU bench: the Llama-family "
        "decoder with d 576, 9 heads of 64 over 3 key/value heads, d_ff 1536, 10 layers (of 30), "
        "vocabulary 49152, rope theta 100000, RMSNorm eps 1e-5, tied head, max_len 2048.",
        ModelConfig(
            arch="decoder-only", d_model=576, n_heads=9, n_kv_heads=3, d_ff=1536, n_decoder_layers=10,
            tgt_vocab_size=49152, max_len=2048, norm_position="pre", norm="rmsnorm", norm_eps=1e-5,
            final_norm=True, positional="rope", rope_theta=100000.0, embed_scale=False, activation="swish",
            gated_ffn=True, qkv_bias=False, bias=False, tie_head=True,
        ),
    ),
}


def list_presets() -> list[str]:
    """Names of the presets, in a stable order."""
    return list(_PRESETS)


def get_preset(name: str) -> ModelConfig:
    """The preset's ModelConfig; ConfigError (listing the known names) for an unknown name."""
    try:
        return _PRESETS[name][1]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown preset {name!r}; known presets: {', '.join(_PRESETS)}") from None


def describe_preset(name: str) -> str:
    """Where the preset comes from, in one paragraph."""
    get_preset(name)
    return _PRESETS[name][0]
