"""The packed records of finished bins: the packers' per-row bookkeeping, in C.

``packed_records`` turns what ``BinFill.take`` hands over into one ``SampleRecord`` per bin. Its
payload holds the bin's block as row views (``tokens``, ``segment_ids``, ``positions``, then the
side fields, a float32 one read from its stored bits); no token is copied. Its meta carries:

- the primary cursor, the first fragment's input cursor with the fragment's start as a child;
- the contributors, every fragment's refs in order, closing only for the fragment that ends its
  input (the others' refs are re-issued as not last);
- the mixture heritage: fragments per component, and tokens per component, None as soon as one
  input carries no token counts. An input of several components is laid out by ``spread``
  (``zephon.ops.packing._count_spread``), which stays the one statement of that rule.
"""

cimport numpy as cnp
from zephon._core._types cimport offset_t
from zephon._core.cursor cimport SampleCursor
from zephon._core.records cimport ContributorRef, SampleMeta, SampleRecord, make_meta, make_record

import numpy as np

cnp.import_array()

cdef inline object _row(cnp.ndarray block, object owner, Py_ssize_t k, int typenum):
    # Row ``k`` of an int32 block whose rows are C-contiguous, as a view of it (``block[k]``, or
    # its bits as float32) whose base is ``owner``, what holds the block's memory.
    cdef cnp.npy_intp n = cnp.PyArray_DIM(block, 1)
    cdef char* data = <char*>cnp.PyArray_DATA(block) + k * cnp.PyArray_STRIDE(block, 0)
    cdef cnp.ndarray view = cnp.PyArray_New(
        np.ndarray, 1, &n, typenum, NULL, data, 4, cnp.NPY_ARRAY_CARRAY, None
    )
    cnp.set_array_base(view, owner)
    return view


cdef inline object _owner(cnp.ndarray block):
    # What holds a block's memory: the block, or what it is a view of. numpy keeps a view's base
    # as given when that is not an ndarray (a BinFill's RowArena), and collate looks for it there.
    if cnp.PyArray_CHKFLAGS(block, cnp.NPY_ARRAY_OWNDATA) or cnp.PyArray_BASE(block) == NULL:
        return block
    return <object>cnp.PyArray_BASE(block)


cdef cnp.ndarray _block(object block, Py_ssize_t rows):
    if not (
        type(block) is np.ndarray
        and cnp.PyArray_NDIM(<cnp.ndarray>block) == 2
        and cnp.PyArray_TYPE(<cnp.ndarray>block) == cnp.NPY_INT32
        and cnp.PyArray_ISNOTSWAPPED(<cnp.ndarray>block)
        and cnp.PyArray_ISALIGNED(<cnp.ndarray>block)
        and cnp.PyArray_STRIDE(<cnp.ndarray>block, 1) == 4
        and cnp.PyArray_DIM(<cnp.ndarray>block, 0) == rows
    ):
        raise TypeError(
            f"packed_records: a bin's block must be an int32 array of {rows} rows, each "
            f"C-contiguous, got {block!r:.80}"
        )
    return <cnp.ndarray>block


cdef inline void _count(dict counts, object key, object n) except *:
    counts[key] = counts.get(key, 0) + n


def packed_records(list blocks not None, list bin_records not None,
                   const offset_t[:, ::1] frags not None, offset_t lane_id, tuple sides not None,
                   spread not None):
    """One ``SampleRecord`` per bin (see the module docstring), in the order given.

    ``blocks`` and ``bin_records`` are ``BinFill.take``'s per-bin blocks and fragment inputs,
    ``frags`` its ``(frag_start, frag_len, item_len)`` rows, bin after bin; ``sides`` the side
    fields as ``(name, is_float32)`` pairs in block order; ``spread(meta, n, start, size, samples,
    tokens)`` adds the counts of a fragment of an input of several components. ValueError when
    the fragments and the rows disagree, TypeError for a block that is not a bin's.
    """
    cdef Py_ssize_t n_bins = len(blocks), n_rows = frags.shape[0], b, at = 0, i, k, n_frags
    cdef Py_ssize_t n_block_rows = 3 + len(sides)
    if lane_id < 0:
        raise ValueError(f"packed_records: lane_id must be >= 0, got {lane_id}")
    if len(bin_records) != n_bins:
        raise ValueError(f"packed_records: {n_bins} blocks but {len(bin_records)} fragment lists")
    if frags.shape[1] != 3:
        raise ValueError(f"packed_records: frags must have 3 columns, got {frags.shape[1]}")
    cdef list out = [None] * n_bins
    cdef list recs, refs
    cdef dict samples, payload
    cdef object tokens, comp, sc, tc
    cdef offset_t start, size, n
    cdef cnp.ndarray block
    cdef SampleMeta meta, made
    cdef SampleRecord rec
    cdef ContributorRef ref, ended
    cdef tuple own
    for b in range(n_bins):
        block = _block(blocks[b], n_block_rows)
        recs = <list?>bin_records[b]
        n_frags = len(recs)
        if not n_frags or at + n_frags > n_rows:
            raise ValueError(
                f"packed_records: bin {b} has {n_frags} fragments, {n_rows - at} rows are left"
            )
        refs = []
        samples = {}
        tokens = {}
        primary = (<SampleRecord?>recs[0]).meta.cursor.child(frags[at, 0])
        for i in range(n_frags):
            rec = <SampleRecord?>recs[i]
            start, size, n = frags[at, 0], frags[at, 1], frags[at, 2]
            at += 1
            meta = rec.meta
            own = meta.contribution_refs()
            if start + size == n:  # the fragment that ends its input keeps the closing flags
                refs.extend(own)
            else:
                for ref in own:
                    if ref.is_last_child:
                        ended = ContributorRef.__new__(ContributorRef)
                        ended.cursor = ref.cursor
                        ended.is_last_child = False
                        refs.append(ended)
                    else:
                        refs.append(ref)
            sc = meta.component_sample_counts
            tc = meta.component_token_counts
            if sc is None and tc is None:  # untokenized input of one component
                _count(samples, meta.component, 1)
                tokens = None
            elif (sc is None or len(sc) == 1) and (tc is None or len(tc) == 1):
                # One component (the common case): a fragment is one sample of it.
                for comp in (sc if sc is not None else tc):
                    break
                _count(samples, comp, 1)
                if tc is None:
                    tokens = None
                elif tokens is not None:
                    _count(tokens, comp, size)
            else:
                if tc is None:
                    tokens = None
                spread(meta, n, start, size, samples, tokens)
        owner = _owner(block)
        payload = {
            "tokens": _row(block, owner, 0, cnp.NPY_INT32),
            "segment_ids": _row(block, owner, 1, cnp.NPY_INT32),
            "positions": _row(block, owner, 2, cnp.NPY_INT32),
        }
        for k in range(3, n_block_rows):
            name, is_float = sides[k - 3]
            payload[name] = _row(block, owner, k, cnp.NPY_FLOAT32 if is_float else cnp.NPY_INT32)
        made = make_meta(<SampleCursor?>primary, lane_id, None)
        made.contributors = tuple(refs)
        made.component_sample_counts = samples
        made.component_token_counts = tokens
        out[b] = make_record(made, payload)
    if at != n_rows:
        raise ValueError(f"packed_records: {n_rows} fragment rows but the bins hold {at}")
    return out
