/* The kernel session's read of its next request from /dev/fuse, spinning a while before it
 * gives up (mount/receiver.py says why, and holds the same loop in Python: _read_calls, whose
 * contract this keeps). In C the spin costs no exception per empty read and lets the GIL go
 * once; a request is seen within a read's time of its arrival. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* read_request(fd, buffer, spin_ns) -> size, or -errno: one read of the (non-blocking) fd
 * into the buffer, again while it finds nothing (EAGAIN) for up to spin_ns; a request the
 * kernel withdrew before we read it (ENOENT) is read past. -EAGAIN: nothing came. */
static PyObject *read_request(PyObject *Py_UNUSED(module), PyObject *args)
{
    int fd;
    Py_buffer buffer;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "iw*L", &fd, &buffer, &spin_ns))
        return NULL;
    ssize_t got;
    int failed_errno;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        long long until = spin_ns > 0 ? now_ns() + spin_ns : 0;
        for (;;) {
            got = read(fd, buffer.buf, (size_t)buffer.len);
            failed_errno = got < 0 ? errno : 0;
            if (failed_errno == ENOENT)
                continue;
            if (failed_errno != EAGAIN || spin_ns <= 0 || now_ns() >= until)
                break;
        }
        Py_END_ALLOW_THREADS
        if (failed_errno != EINTR)
            break;
        if (PyErr_CheckSignals() < 0) { /* as os.* do (PEP 475): handlers first, then again */
            PyBuffer_Release(&buffer);
            return NULL;
        }
    }
    PyBuffer_Release(&buffer);
    return PyLong_FromSsize_t(failed_errno ? -failed_errno : got);
}

static PyMethodDef methods[] = {
    {"read_request", read_request, METH_VARARGS,
     "Read the next FUSE request, spinning while none is there; its size or -errno."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_dev_read",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__dev_read(void) { return PyModule_Create(&module); }
