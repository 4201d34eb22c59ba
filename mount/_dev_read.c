/* The kernel session's read of its next request from /dev/fuse, spinning a while before it
 * gives up (mount/receiver.py says why, and holds the same loop in Python: _read_calls, whose
 * contract this keeps). In C the spin costs no exception per empty read and lets the GIL go
 * once; a request is seen within a read's time of its arrival. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
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

/* The FUSE wire: the request header every request starts with, the reply header. */
struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
#define FUSE_LOOKUP 1
#define NAME_MAX_BYTES 255

/* answer_miss(fd, buffer, size, dirs, noted, entry) -> int: where the request in buffer[:size]
 * is a LOOKUP in a directory of dirs (nodeid -> its children, a dict) of a name those children
 * lack, answer it with entry (a negative fuse_entry_out), append (nodeid, name) to noted and
 * return the nanoseconds it took before the answer's write (at least 1), or -errno where that
 * write failed. 0 for any other request: untouched, for Python to serve. (".", ".." and
 * over-long names are Python's too.) */
static PyObject *answer_miss(PyObject *Py_UNUSED(module), PyObject *args)
{
    int fd;
    Py_buffer buffer, entry;
    Py_ssize_t size;
    PyObject *dirs, *noted;
    if (!PyArg_ParseTuple(args, "iy*nO!O!y*", &fd, &buffer, &size, &PyDict_Type, &dirs,
                          &PyList_Type, &noted, &entry))
        return NULL;
    long long start = now_ns(), took = 0;
    PyObject *result = NULL, *key = NULL, *name = NULL, *note = NULL;
    struct in_header in;
    if (size < (Py_ssize_t)sizeof in || size > buffer.len)
        goto not_mine;
    memcpy(&in, buffer.buf, sizeof in);
    Py_ssize_t end = size - (Py_ssize_t)in.total_extlen * 8;
    if (in.opcode != FUSE_LOOKUP || end <= (Py_ssize_t)sizeof in)
        goto not_mine;
    const char *chars = (const char *)buffer.buf + sizeof in;
    size_t length = strnlen(chars, (size_t)(end - (Py_ssize_t)sizeof in));
    if (length == 0 || length > NAME_MAX_BYTES || (chars[0] == '.' && (length == 1 ||
                                                   (length == 2 && chars[1] == '.'))))
        goto not_mine;
    key = PyLong_FromUnsignedLongLong(in.nodeid);
    if (key == NULL)
        goto out;
    PyObject *children = PyDict_GetItemWithError(dirs, key); /* borrowed */
    if (children == NULL) {
        if (PyErr_Occurred())
            goto out;
        goto not_mine;
    }
    if (!PyDict_Check(children))
        goto not_mine;
    name = PyBytes_FromStringAndSize(chars, (Py_ssize_t)length);
    if (name == NULL)
        goto out;
    int found = PyDict_Contains(children, name);
    if (found < 0)
        goto out;
    if (found)
        goto not_mine;
    note = PyTuple_Pack(2, key, name);
    if (note == NULL || PyList_Append(noted, note) < 0)
        goto out;
    struct out_header header = {(uint32_t)(sizeof header + (size_t)entry.len), 0, in.unique};
    struct iovec parts[2] = {{&header, sizeof header}, {entry.buf, (size_t)entry.len}};
    took = now_ns() - start;
    ssize_t wrote;
    int failed_errno;
    Py_BEGIN_ALLOW_THREADS
    wrote = writev(fd, parts, 2);
    failed_errno = wrote < 0 ? errno : 0;
    Py_END_ALLOW_THREADS
    result = PyLong_FromLongLong(failed_errno ? -failed_errno : (took > 0 ? took : 1));
    goto out;
not_mine:
    result = PyLong_FromLong(0);
out:
    Py_XDECREF(note);
    Py_XDECREF(name);
    Py_XDECREF(key);
    PyBuffer_Release(&entry);
    PyBuffer_Release(&buffer);
    return result;
}

static PyMethodDef methods[] = {
    {"read_request", read_request, METH_VARARGS,
     "Read the next FUSE request, spinning while none is there; its size or -errno."},
    {"answer_miss", answer_miss, METH_VARARGS,
     "Answer a LOOKUP that misses in a known directory without the interpreter."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_dev_read",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__dev_read(void) { return PyModule_Create(&module); }
