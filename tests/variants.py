"""Config variants shared by the conformance tests: together they cover every ModelConfig option."""

from spec import get_preset

TINY = get_preset("tiny")

VARIANTS = {
    "tiny": TINY,
    "tiny.pre_std_final": TINY.replace(norm_position="pre", norm="std", final_norm=True),
    "tiny.concat_gelu_untied": TINY.replace(positional="sinusoidal-concat", activation="gelu", tie_head=False,
                                            head_bias=True),
    "tiny.learned_swish_shared_embednorm": TINY.replace(
        positional="learned", embed_scale=False, activation="swish", src_vocab_size=80, share_src_tgt_embed=True,
        pad_id=3, embed_norm=True),
    "tiny.nobias_gelutanh": TINY.replace(qkv_bias=False, bias=False, activation="gelu-tanh", max_len=6,
                                         positional="learned"),
    "char-lm": get_preset("char-lm").replace(n_decoder_layers=2),
}
