"""Slot encodings of the promotion pool, shared by its torch code (``certvllm.kv.promotion_cache``) and
its Triton kernels (``triton_kernels/pool.py``).

* A page (16-token block id · KV heads + KV head, int64) may sit in two slots of a pool of ``P`` slots:
  ``page mod P`` and ``((page · HASH_MUL) >> 7) mod P`` (exact in int64 for page < 2^32).
* Claims on a slot are int64 maxima: a miss claims with ``page``, a hit with ``page + CLAIM_HIT``, so a hit
  outranks every miss and ``0 ≤ claim < CLAIM_HIT`` marks a slot to fill.
"""

HASH_MUL = 1540483477
CLAIM_HIT = 1 << 62
