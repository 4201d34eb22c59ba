/* A chunk's load and store, each in one call that lets the GIL go once (kvfs/chunk_io.py says
 * why, and holds the same calls in Python: _load_calls and _store_calls, whose contracts these
 * keep). An interrupted system call (EINTR) undoes what was done, runs the signal handlers and
 * starts again, as os.* do (PEP 475). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/xattr.h>
#include <unistd.h>

/* kvfs.checksum's algorithm (python-xxhash's xxh3_64), from the system's xxHash, inlined */
#define XXH_INLINE_ALL
#include <xxhash.h>

/* load(path, buffer, flags) -> (size, got): open(path, O_RDONLY | flags), the size by a seek
 * to the end, and where it is the buffer's length one pread of it at offset 0; got is -1
 * where the size differs (nothing read). */
static PyObject *load(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *path, *encoded;
    Py_buffer buffer;
    int flags;
    if (!PyArg_ParseTuple(args, "Ow*i", &path, &buffer, &flags))
        return NULL;
    if (!PyUnicode_FSConverter(path, &encoded)) {
        PyBuffer_Release(&buffer);
        return NULL;
    }
    const char *name = PyBytes_AS_STRING(encoded);
    off_t size = -1;
    ssize_t got = -1;
    int failed_errno = 0;
    for (;;) {
        int fd;
        Py_BEGIN_ALLOW_THREADS
        fd = open(name, O_RDONLY | O_CLOEXEC | flags);
        if (fd >= 0) {
            size = lseek(fd, 0, SEEK_END);
            if (size == (off_t)buffer.len)
                got = pread(fd, buffer.buf, (size_t)buffer.len, 0);
            failed_errno = size < 0 || (size == (off_t)buffer.len && got < 0) ? errno : 0;
            close(fd); /* a reader's close reports nothing worth raising */
        } else {
            failed_errno = errno;
        }
        Py_END_ALLOW_THREADS
        if (failed_errno != EINTR)
            break;
        if (PyErr_CheckSignals() < 0) { /* as os.* do (PEP 475): handlers first, then again */
            PyBuffer_Release(&buffer);
            Py_DECREF(encoded);
            return NULL;
        }
        size = -1;
        got = -1;
    }
    PyBuffer_Release(&buffer);
    Py_DECREF(encoded);
    if (failed_errno) {
        errno = failed_errno;
        return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    }
    return Py_BuildValue("(Ln)", (long long)size, got);
}

/* store(tmp, path, data, flags, mode, declare=False) -> written | None: where path is there
 * already, FileExistsError naming path (nothing written); else create tmp (flags hold O_EXCL),
 * one write, close, rename over path; the bytes written (short: not renamed), or None where
 * the directory is missing. tmp is gone afterwards unless renamed, whatever is raised.
 * declare: the bytes' checksum (kvfs.checksum's value) set as user.kvfs.checksum before the
 * close where the whole write went in (where the filesystem refuses it, the store goes on
 * without it). Hashed after the write, not before the call: 50 us of hashing between a
 * mount's round trips leaves its daemon asleep for the next two (measured: the store's
 * create 0.12 -> 0.39 ms). */
static PyObject *store(PyObject *Py_UNUSED(module), PyObject *args)
{
    PyObject *tmp, *path, *tmp_encoded = NULL, *path_encoded = NULL, *result = NULL;
    Py_buffer data;
    int flags, mode, declare = 0;
    if (!PyArg_ParseTuple(args, "OOy*ii|p", &tmp, &path, &data, &flags, &mode, &declare))
        return NULL;
    if (!PyUnicode_FSConverter(tmp, &tmp_encoded) || !PyUnicode_FSConverter(path, &path_encoded)) {
        Py_XDECREF(tmp_encoded);
        PyBuffer_Release(&data);
        return NULL;
    }
    const char *tmp_name = PyBytes_AS_STRING(tmp_encoded);
    const char *path_name = PyBytes_AS_STRING(path_encoded);
    enum { DONE, PRESENT, NO_DIRECTORY, FAILED, FAILED_RENAME } outcome;
    ssize_t written;
    int failed_errno;
    for (;;) {
        Py_BEGIN_ALLOW_THREADS
        outcome = DONE;
        written = -1;
        failed_errno = 0;
        struct stat there;
        int fd = -1;
        /* here, not a call of its own: on a FUSE mount this LOOKUP is a round trip, and the
         * GIL taken back after each costs the engine's I/O thread more than the trip */
        if (stat(path_name, &there) == 0) {
            failed_errno = EEXIST;
            outcome = PRESENT;
        } else if ((fd = open(tmp_name, flags | O_CLOEXEC, mode)) < 0) {
            failed_errno = errno;
            outcome = failed_errno == ENOENT ? NO_DIRECTORY : FAILED;
        } else {
            int renamed = 0;
            written = write(fd, data.buf, (size_t)data.len);
            if (written < 0) {
                failed_errno = errno;
                outcome = FAILED;
            } else if (declare && written == data.len) {
                char value[32];
                int n = snprintf(value, sizeof value, "xxh3-64:%016llx",
                                 (unsigned long long)XXH3_64bits(data.buf, (size_t)data.len));
                (void)fsetxattr(fd, "user.kvfs.checksum", value, (size_t)n, 0);
            }
            if (close(fd) < 0 && outcome == DONE) { /* a kvfs mount reports a failed publish */
                failed_errno = errno;
                outcome = FAILED;
            }
            if (outcome == DONE && written == data.len) {
                if (rename(tmp_name, path_name) == 0)
                    renamed = 1;
                else if (errno != EEXIST) { /* EEXIST: a filesystem that refuses to replace */
                    failed_errno = errno;
                    outcome = FAILED_RENAME;
                }
            }
            if (!renamed)
                unlink(tmp_name);
        }
        Py_END_ALLOW_THREADS
        if (failed_errno != EINTR)
            break;
        if (PyErr_CheckSignals() < 0)
            goto out;
    }
    errno = failed_errno;
    if (outcome == DONE)
        result = PyLong_FromSsize_t(written);
    else if (outcome == NO_DIRECTORY)
        result = Py_NewRef(Py_None);
    else if (outcome == PRESENT)
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, path);
    else if (outcome == FAILED)
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, tmp);
    else
        PyErr_SetFromErrnoWithFilenameObjects(PyExc_OSError, tmp, path);
out:
    Py_DECREF(tmp_encoded);
    Py_DECREF(path_encoded);
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "Open, size and read a chunk file, the GIL let go once."},
    {"store", store, METH_VARARGS,
     "Write a chunk file under a temp name and rename it, the GIL let go once."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_chunk_calls",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__chunk_calls(void) { return PyModule_Create(&module); }
