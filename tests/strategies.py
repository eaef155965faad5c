"""Hypothesis strategies shared by the property tests."""

from hypothesis import strategies as st

from tests.variants import TINY


@st.composite
def small_configs(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    d_model = heads * draw(st.sampled_from([2, 4, 8]))
    decoder_only = draw(st.booleans())
    vocab = draw(st.integers(3, 20))
    positional = draw(st.sampled_from(["sinusoidal", "sinusoidal-concat", "learned"]))
    share = (not decoder_only) and draw(st.booleans())
    return TINY.replace(
        arch="decoder-only" if decoder_only else "encoder-decoder", d_model=d_model, n_heads=heads,
        d_ff=draw(st.integers(1, 24)), n_encoder_layers=0 if decoder_only else draw(st.integers(1, 2)),
        n_decoder_layers=draw(st.integers(1, 2)), src_vocab_size=0 if decoder_only else (vocab if share else draw(st.integers(3, 20))),
        tgt_vocab_size=vocab, max_len=draw(st.integers(8, 16)), pad_id=draw(st.integers(0, 2)),
        norm_position=draw(st.sampled_from(["post", "pre"])), norm=draw(st.sampled_from(["layernorm", "std"])),
        final_norm=draw(st.booleans()), positional=positional, embed_scale=draw(st.booleans()),
        embed_norm=draw(st.booleans()),
        activation=draw(st.sampled_from(["relu", "gelu", "gelu-tanh", "swish"])), qkv_bias=draw(st.booleans()),
        bias=draw(st.booleans()), head_bias=draw(st.booleans()), share_src_tgt_embed=share, tie_head=draw(st.booleans()))
