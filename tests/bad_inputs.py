"""Bad inputs every backend must refuse with the same InputError message (SPEC.md §10).

Each entry: (id, src_ids, tgt_ids, message regex) for the tiny preset (src vocab 96, tgt 80).
"""

import numpy as np

BAD_FORWARD_INPUTS = [
    ("batch_mismatch", np.ones((2, 3), np.int64), np.ones((3, 3), np.int64), "batch sizes differ"),
    ("float_ids", np.ones((2, 3), np.float32), np.ones((2, 3), np.int64), "integer token ids"),
    ("bool_ids", np.ones((2, 3), bool), np.ones((2, 3), np.int64), "integer token ids"),
    ("rank1_ids", np.ones(3, np.int64), np.ones((2, 3), np.int64), "rank 2"),
    ("rank3_ids", np.ones((2, 3, 1), np.int64), np.ones((2, 3), np.int64), "rank 2"),
    ("empty_batch", np.ones((0, 3), np.int64), np.ones((0, 3), np.int64), "empty batch"),
    ("zero_length", np.ones((2, 0), np.int64), np.ones((2, 3), np.int64), "zero-length"),
    ("id_past_vocab", np.full((2, 3), 96), np.ones((2, 3), np.int64), r"token id 96, outside the vocabulary \[0, 96\)"),
    ("negative_id", np.ones((2, 3), np.int64), np.full((2, 3), -1), "token id -1"),
    ("missing_source", None, np.ones((2, 3), np.int64), "needs src_ids"),
    ("list_not_array", [[1, 2]], np.ones((1, 3), np.int64), "must be an array"),
]

# Generation arguments for tiny (encoder-decoder): (id, keyword arguments, message regex).
BAD_GENERATION = [
    ("zero_new_tokens", {"src_ids": np.ones((1, 3), np.int64), "bos_id": 1, "max_new_tokens": 0}, "positive integer"),
    ("float_new_tokens", {"src_ids": np.ones((1, 3), np.int64), "bos_id": 1, "max_new_tokens": 2.0}, "positive integer"),
    ("no_bos", {"src_ids": np.ones((1, 3), np.int64), "max_new_tokens": 2}, "needs bos_id"),
    ("bos_past_vocab", {"src_ids": np.ones((1, 3), np.int64), "bos_id": 80, "max_new_tokens": 2}, "needs bos_id"),
    ("bad_source", {"src_ids": np.full((1, 3), 99), "bos_id": 1, "max_new_tokens": 2}, "token id 99"),
]
