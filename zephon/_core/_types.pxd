# Shared C types of the compiled core, matching numpy's dtypes, stated once.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t

ctypedef int64_t offset_t    # chunk ids, chunk offsets, sample ids, lengths: numpy int64
ctypedef int32_t token_t     # token ids: numpy int32
ctypedef uint64_t word_t     # one word of an offset bitmap
