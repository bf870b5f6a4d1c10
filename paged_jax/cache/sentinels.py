"""The block manager's sentinel values, in one leaf module (no imports) so that every
layer (cache, KV pages, steps, engine) can name them without importing the state.

All three are -1: an out-of-range id that no valid entry can take, and that the ops
send out of bounds (``mode="drop"``) rather than index with.
"""

NO_BLOCK = -1
"""A block-table entry that names no physical block (entries past a row's length)."""

NO_SEQ = -1
"""A padding entry in a batch of sequence ids: the ops ignore it (status OK), so a
caller can pad batches to a few bucket sizes and keep the number of traces bounded."""

NO_SLOT = -1
"""A slot-mapping entry of a padding token (no KV slot is written for it)."""
