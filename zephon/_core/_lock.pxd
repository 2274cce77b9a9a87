# The owned lock of the kernels' cdef classes: a PyThread lock plus the ident of the thread that
# holds it, so a call re-entering from inside one of the object's own calls fails instead of
# deadlocking. Taken without waiting when free; otherwise waited for with the GIL released.
from cpython.pythread cimport (
    NOWAIT_LOCK,
    WAIT_LOCK,
    PyThread_acquire_lock,
    PyThread_get_thread_ident,
    PyThread_release_lock,
    PyThread_type_lock,
)


cdef inline int take_lock(
    PyThread_type_lock lock, long* owner, str name, str refusal=None
) except -1:
    # The thread holding the lock taking it again: a RuntimeError, ``refusal`` when given.
    cdef long me = PyThread_get_thread_ident()
    if owner[0] == me:
        raise RuntimeError(
            refusal or f"{name} was called again while this thread is inside one of its calls"
        )
    if not PyThread_acquire_lock(lock, NOWAIT_LOCK):
        with nogil:
            PyThread_acquire_lock(lock, WAIT_LOCK)
    owner[0] = me
    return 0


cdef inline void drop_lock(PyThread_type_lock lock, long* owner) noexcept:
    owner[0] = 0
    PyThread_release_lock(lock)
