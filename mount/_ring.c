/* The kernel session's requests over FUSE-over-io_uring (Linux 6.14+, module parameter
 * fuse.enable_uring=Y): mount/ring.py says why and how the session uses it.
 *
 * The kernel keeps one request queue per possible CPU and queues a request on its caller's
 * CPU. Here one thread per queue, pinned to that CPU, holds ENTRIES registered ring entries
 * (a header buffer and a payload buffer each) in an io_uring of its own. A request that lands
 * in an entry is
 *   - answered on the spot when it is a first-time miss (a LOOKUP, in a directory of `dirs`, of
 *     a name its children lack) and the trio loop is idle (it lets the index go only
 *     while it waits: every task is then at an await, the index whole): a negative entry, the
 *     miss noted for the hit rate. Caller and answer never leave the CPU, nor touch the loop;
 *   - else handed to the loop: `take` copies it into the loop's buffer as /dev/fuse would have
 *     delivered it, the handler answers through `reply`, and the queue's thread, woken by an
 *     eventfd, commits that answer and fetches the entry's next request.
 * Forgets, interrupts and notifications stay on /dev/fuse (the kernel's rule). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <linux/io_uring.h>

/* From the kernel's include/uapi/linux/fuse.h (7.42+), newer than the installed headers. */
#define CMD_REGISTER 1         /* FUSE_IO_URING_CMD_REGISTER */
#define CMD_COMMIT_AND_FETCH 2 /* FUSE_IO_URING_CMD_COMMIT_AND_FETCH */
struct ent_in_out { uint64_t flags, commit_id; uint32_t payload_sz, padding; uint64_t reserved; };
struct ring_header { char in_out[128]; char op_in[128]; struct ent_in_out ent; };
struct cmd_req { uint64_t flags, commit_id; uint16_t qid; uint8_t padding[6]; };
struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct out_header { uint32_t len; int32_t error; uint64_t unique; };

#define FUSE_LOOKUP 1
#define NAME_MAX_BYTES 255
#define SQE_SIZE 128           /* IORING_SETUP_SQE128: the fuse command needs the long form */
#define WAKE_TAG UINT64_MAX    /* the user_data of the queue's eventfd read */
#define MISSES_KEPT 65536 /* misses answered here, not yet timed by the loop (more: the loop answers) */

enum { IN_KERNEL, HANDED, WITH_LOOP, ANSWERED };
enum { LOOP_IDLE, LOOP_BUSY, MISS_ANSWERED };

struct queue;
struct entry {
    struct ring_header *header;
    char *payload;
    struct iovec iov[2];
    struct queue *queue;
    uint64_t unique;     /* the request's, while the loop holds it */
    int state;           /* enum above; WITH_LOOP and its end are the loop thread's */
    struct entry *next;  /* in the hand-off list or the queue's commit list */
};

struct queue {
    struct Ring *ring;
    int qid, fd, wake_fd, registered;
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask, to_submit;
    char *rings, *sqes;
    struct io_uring_cqe *cqes;
    size_t rings_size, sqes_size;
    struct entry *entries;
    pthread_mutex_t lock; /* the commit list */
    struct entry *commits;
    uint64_t wake_count;
    PyThreadState *tstate;
    pthread_t thread;
    int started, done, error;
};

typedef struct Ring {
    PyObject_HEAD
    int dev_fd, loop_fd, queues, entries, stopping, closed;
    size_t payload_size;
    unsigned char arg0[64]; /* opcode -> size of its own header (the ring's op_in) */
    struct queue *queue;
    pthread_mutex_t handoff_lock;
    struct entry *handoff, *handoff_tail;
    int loop_sleeping, queues_done;
    int index_state; /* LOOP_BUSY whenever the loop thread runs Python (see loop_busy) */
    PyObject *dirs, *noted; /* fast misses: the index's dicts, where misses are noted */
    char miss[256];         /* the negative entry they are answered with */
    size_t miss_size;
    long long *missed_ns; /* MISSES_KEPT of them */
    int misses;
} Ring;

static long long now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void wake(int fd)
{
    uint64_t one = 1;
    while (write(fd, &one, sizeof one) < 0 && errno == EINTR)
        ;
}

/* -- one queue's io_uring ------------------------------------------------------------------ */

static int ring_setup(struct queue *q, unsigned depth)
{
    struct io_uring_params p = {.flags = IORING_SETUP_SQE128};
    q->fd = (int)syscall(__NR_io_uring_setup, depth, &p);
    if (q->fd < 0)
        return -errno;
    size_t sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    q->rings_size = sq_size > cq_size ? sq_size : cq_size; /* IORING_FEAT_SINGLE_MMAP */
    q->sqes_size = p.sq_entries * SQE_SIZE;
    char *rings = mmap(NULL, q->rings_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                       q->fd, IORING_OFF_SQ_RING);
    if (rings == MAP_FAILED)
        return -errno;
    q->rings = rings;
    q->sqes = mmap(NULL, q->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, q->fd,
                   IORING_OFF_SQES);
    if (q->sqes == MAP_FAILED) {
        q->sqes = NULL;
        return -errno;
    }
    q->sq_tail = (void *)(rings + p.sq_off.tail);
    q->sq_mask = (void *)(rings + p.sq_off.ring_mask);
    q->sq_array = (void *)(rings + p.sq_off.array);
    q->cq_head = (void *)(rings + p.cq_off.head);
    q->cq_tail = (void *)(rings + p.cq_off.tail);
    q->cq_mask = (void *)(rings + p.cq_off.ring_mask);
    q->cqes = (void *)(rings + p.cq_off.cqes);
    return 0;
}

static struct io_uring_sqe *next_sqe(struct queue *q, uint64_t tag)
{
    unsigned tail = *q->sq_tail, slot = tail & *q->sq_mask;
    struct io_uring_sqe *sqe = (void *)(q->sqes + (size_t)slot * SQE_SIZE);
    memset(sqe, 0, SQE_SIZE);
    sqe->user_data = tag;
    q->sq_array[slot] = slot;
    __atomic_store_n(q->sq_tail, tail + 1, __ATOMIC_RELEASE);
    q->to_submit++;
    return sqe;
}

/* Register an entry, or commit its answer and fetch its next request. */
static void queue_command(struct queue *q, struct entry *e, int op)
{
    struct io_uring_sqe *sqe = next_sqe(q, (uint64_t)(e - q->entries));
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = q->ring->dev_fd;
    sqe->cmd_op = op;
    sqe->addr = (uintptr_t)e->iov;
    sqe->len = 2;
    struct cmd_req *req = (void *)sqe->cmd;
    req->commit_id = op == CMD_COMMIT_AND_FETCH ? e->header->ent.commit_id : 0;
    req->qid = (uint16_t)q->qid;
    e->state = IN_KERNEL;
}

static void queue_wake_read(struct queue *q)
{
    struct io_uring_sqe *sqe = next_sqe(q, WAKE_TAG);
    sqe->opcode = IORING_OP_READ;
    sqe->fd = q->wake_fd;
    sqe->addr = (uintptr_t)&q->wake_count;
    sqe->len = sizeof q->wake_count;
}

static int submit(struct queue *q, unsigned wait)
{
    for (;;) {
        int n = (int)syscall(__NR_io_uring_enter, q->fd, q->to_submit, wait,
                             wait ? IORING_ENTER_GETEVENTS : 0, NULL, 0);
        if (n >= 0) {
            q->to_submit -= (unsigned)n;
            return 0;
        }
        if (errno != EINTR)
            return -errno;
    }
}

/* -- first-time misses, answered on the queue's thread ------------------------------------- */

/* 1 when the request in e is a first-time miss, answered; 0 when it is the loop's. */
static int answer_miss(struct queue *q, struct entry *e)
{
    Ring *r = q->ring;
    struct in_header in;
    memcpy(&in, e->header->in_out, sizeof in);
    size_t size = e->header->ent.payload_sz;
    if (in.opcode != FUSE_LOOKUP || r->miss_size == 0 || size == 0 || size > r->payload_size)
        return 0;
    const char *chars = e->payload;
    size_t length = strnlen(chars, size);
    if (length == 0 || length > NAME_MAX_BYTES ||
        (chars[0] == '.' && (length == 1 || (length == 2 && chars[1] == '.'))))
        return 0;
    int idle = LOOP_IDLE;
    if (!__atomic_compare_exchange_n(&r->index_state, &idle, MISS_ANSWERED, 0, __ATOMIC_ACQUIRE,
                                     __ATOMIC_RELAXED))
        return 0; /* the loop is running: the index may be half way through a change */
    long long start = now_ns();
    int answered = 0;
    if (r->misses < MISSES_KEPT) {
        PyEval_RestoreThread(q->tstate);
        PyObject *key = PyLong_FromUnsignedLongLong(in.nodeid), *name = NULL, *note = NULL;
        PyObject *children = key ? PyDict_GetItemWithError(r->dirs, key) : NULL; /* borrowed */
        if (children != NULL && PyDict_Check(children) &&
            (name = PyBytes_FromStringAndSize(chars, (Py_ssize_t)length)) != NULL &&
            PyDict_Contains(children, name) == 0 && (note = PyTuple_Pack(2, key, name)) != NULL &&
            PyList_Append(r->noted, note) == 0)
            answered = 1;
        PyErr_Clear(); /* a failure leaves the request to the loop, which will say it */
        Py_XDECREF(note);
        Py_XDECREF(name);
        Py_XDECREF(key);
        PyEval_SaveThread();
    }
    if (answered) {
        size_t entry_size = r->miss_size;
        memcpy(e->payload, r->miss, entry_size);
        struct out_header out = {(uint32_t)(sizeof out + entry_size), 0, in.unique};
        memcpy(e->header->in_out, &out, sizeof out);
        e->header->ent.payload_sz = (uint32_t)entry_size;
        r->missed_ns[r->misses++] = now_ns() - start;
        queue_command(q, e, CMD_COMMIT_AND_FETCH);
        /* in the kernel before the loop may change the index: no negative entry outlives a
         * name made after this look */
        if (submit(q, 0) < 0)
            q->error = errno;
    }
    __atomic_store_n(&r->index_state, LOOP_IDLE, __ATOMIC_RELEASE);
    return answered;
}

static void hand_over(Ring *r, struct entry *e)
{
    e->state = HANDED;
    e->next = NULL;
    pthread_mutex_lock(&r->handoff_lock);
    if (r->handoff_tail)
        r->handoff_tail->next = e;
    else
        r->handoff = e;
    r->handoff_tail = e;
    pthread_mutex_unlock(&r->handoff_lock);
    if (__atomic_exchange_n(&r->loop_sleeping, 0, __ATOMIC_SEQ_CST))
        wake(r->loop_fd);
}

static void *serve_queue(void *arg)
{
    struct queue *q = arg;
    Ring *r = q->ring;
    cpu_set_t cpu;
    CPU_ZERO(&cpu);
    CPU_SET(q->qid, &cpu);
    pthread_setaffinity_np(pthread_self(), sizeof cpu, &cpu); /* an offline CPU: anywhere */
    for (int i = 0; i < r->entries; i++)
        queue_command(q, &q->entries[i], CMD_REGISTER);
    queue_wake_read(q);
    int live = r->entries;
    while (live > 0 && !__atomic_load_n(&r->stopping, __ATOMIC_ACQUIRE)) {
        if (submit(q, 1) < 0) {
            q->error = errno;
            break;
        }
        unsigned head = *q->cq_head;
        while (head != __atomic_load_n(q->cq_tail, __ATOMIC_ACQUIRE)) {
            struct io_uring_cqe cqe = q->cqes[head & *q->cq_mask];
            __atomic_store_n(q->cq_head, ++head, __ATOMIC_RELEASE);
            if (cqe.user_data == WAKE_TAG) { /* answers from the loop to commit */
                pthread_mutex_lock(&q->lock);
                struct entry *e = q->commits;
                q->commits = NULL;
                pthread_mutex_unlock(&q->lock);
                for (; e != NULL; e = e->next)
                    queue_command(q, e, CMD_COMMIT_AND_FETCH);
                queue_wake_read(q);
                continue;
            }
            struct entry *e = &q->entries[cqe.user_data];
            if (cqe.res < 0) { /* ENOTCONN, ECANCELED: the connection is gone */
                if (cqe.res != -ENOTCONN && cqe.res != -ECANCELED)
                    q->error = -cqe.res;
                e->state = IN_KERNEL;
                live--;
                continue;
            }
            if (!answer_miss(q, e))
                hand_over(r, e);
        }
    }
    __atomic_store_n(&q->done, 1, __ATOMIC_RELEASE);
    __atomic_add_fetch(&r->queues_done, 1, __ATOMIC_SEQ_CST);
    __atomic_store_n(&r->loop_sleeping, 0, __ATOMIC_SEQ_CST);
    wake(r->loop_fd);
    return NULL;
}

/* -- the Python object ---------------------------------------------------------------------- */

static void ring_free_queues(Ring *r)
{
    for (int i = 0; i < r->queues && r->queue; i++) {
        struct queue *q = &r->queue[i];
        if (q->entries) {
            for (int j = 0; j < r->entries; j++) {
                free(q->entries[j].header);
                free(q->entries[j].payload);
            }
            free(q->entries);
        }
        if (q->sqes)
            munmap(q->sqes, q->sqes_size);
        if (q->rings)
            munmap(q->rings, q->rings_size);
        if (q->fd > 0)
            close(q->fd);
        if (q->wake_fd > 0)
            close(q->wake_fd);
        if (q->tstate) {
            PyThreadState_Clear(q->tstate);
            PyThreadState_Delete(q->tstate);
        }
        pthread_mutex_destroy(&q->lock);
    }
    free(r->queue);
    r->queue = NULL;
}

/* Stop the queues' threads and let go of the rings (the kernel's entries go with them). */
static PyObject *ring_close(Ring *r, PyObject *Py_UNUSED(ignored))
{
    if (r->closed)
        Py_RETURN_NONE;
    r->closed = 1;
    __atomic_store_n(&r->stopping, 1, __ATOMIC_RELEASE);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < r->queues; i++)
        if (r->queue[i].started) {
            wake(r->queue[i].wake_fd);
            pthread_join(r->queue[i].thread, NULL);
        }
    Py_END_ALLOW_THREADS
    ring_free_queues(r);
    if (r->loop_fd > 0)
        close(r->loop_fd);
    r->loop_fd = -1;
    Py_CLEAR(r->dirs);
    Py_CLEAR(r->noted);
    Py_RETURN_NONE;
}

static void ring_dealloc(Ring *r)
{
    if (!r->closed && r->queue) {
        PyObject *none = ring_close(r, NULL);
        Py_XDECREF(none);
    }
    Py_XDECREF(r->dirs);
    Py_XDECREF(r->noted);
    pthread_mutex_destroy(&r->handoff_lock);
    free(r->missed_ns);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

/* Ring(dev_fd, queues, entries, payload_size, arg0_sizes): queues' threads start at once and
 * register their entries; the kernel hands requests over once every queue has one. */
static int ring_init(Ring *r, PyObject *args, PyObject *Py_UNUSED(kwds))
{
    Py_buffer arg0;
    Py_ssize_t payload_size;
    if (!PyArg_ParseTuple(args, "iiiny*", &r->dev_fd, &r->queues, &r->entries, &payload_size,
                          &arg0))
        return -1;
    if (r->queue != NULL || r->closed) {
        PyBuffer_Release(&arg0);
        PyErr_SetString(PyExc_RuntimeError, "a Ring starts once");
        return -1;
    }
    memset(r->arg0, 0, sizeof r->arg0);
    memcpy(r->arg0, arg0.buf, arg0.len < 64 ? (size_t)arg0.len : 64);
    PyBuffer_Release(&arg0);
    if (r->queues < 1 || r->entries < 1 || payload_size < 4096) {
        PyErr_SetString(PyExc_ValueError, "a ring needs queues, entries and payload room");
        return -1;
    }
    r->payload_size = (size_t)payload_size;
    pthread_mutex_init(&r->handoff_lock, NULL);
    r->index_state = LOOP_BUSY; /* the loop runs: it lets go only where it waits */
    r->loop_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    r->queue = calloc((size_t)r->queues, sizeof *r->queue);
    r->missed_ns = calloc(MISSES_KEPT, sizeof *r->missed_ns);
    if (r->loop_fd < 0 || r->queue == NULL || r->missed_ns == NULL)
        goto failed;
    unsigned depth = 1;
    while (depth < (unsigned)r->entries + 2)
        depth <<= 1;
    for (int i = 0; i < r->queues; i++) {
        struct queue *q = &r->queue[i];
        q->ring = r;
        q->qid = i;
        pthread_mutex_init(&q->lock, NULL);
        q->wake_fd = eventfd(0, EFD_CLOEXEC);
        q->entries = calloc((size_t)r->entries, sizeof *q->entries);
        if (q->wake_fd < 0 || q->entries == NULL)
            goto failed;
        for (int j = 0; j < r->entries; j++) {
            struct entry *e = &q->entries[j];
            e->queue = q;
            e->header = aligned_alloc(4096, 4096);
            e->payload = aligned_alloc(4096, (r->payload_size + 4095) & ~(size_t)4095);
            if (e->header == NULL || e->payload == NULL)
                goto failed;
            memset(e->header, 0, 4096);
            e->iov[0] = (struct iovec){e->header, sizeof *e->header};
            e->iov[1] = (struct iovec){e->payload, r->payload_size};
        }
        int err = ring_setup(q, depth);
        if (err) {
            errno = -err;
            goto failed;
        }
        q->tstate = PyThreadState_New(PyThreadState_Get()->interp);
    }
    for (int i = 0; i < r->queues; i++) {
        int err = pthread_create(&r->queue[i].thread, NULL, serve_queue, &r->queue[i]);
        if (err) {
            errno = err;
            goto failed;
        }
        r->queue[i].started = 1;
    }
    return 0;
failed:
    PyErr_SetFromErrno(PyExc_OSError);
    PyObject *none = ring_close(r, NULL);
    Py_XDECREF(none);
    return -1;
}

/* fast_misses(dirs, noted, negative_entry): answer first-time misses on the queues' threads
 * (FastMisses in mount/lookups.py). */
static PyObject *ring_fast_misses(Ring *r, PyObject *args)
{
    PyObject *dirs, *noted;
    Py_buffer miss;
    if (!PyArg_ParseTuple(args, "O!O!y*", &PyDict_Type, &dirs, &PyList_Type, &noted, &miss))
        return NULL;
    if (r->miss_size != 0 || miss.len < 1 || (size_t)miss.len > sizeof r->miss) {
        PyBuffer_Release(&miss);
        PyErr_SetString(PyExc_ValueError, "fast misses are set once, with an entry_out");
        return NULL;
    }
    Py_INCREF(dirs);
    Py_INCREF(noted);
    r->dirs = dirs;
    r->noted = noted;
    memcpy(r->miss, miss.buf, (size_t)miss.len);
    __atomic_store_n(&r->miss_size, (size_t)miss.len, __ATOMIC_RELEASE); /* last: looked at first */
    PyBuffer_Release(&miss);
    Py_RETURN_NONE;
}

/* The loop runs Python again: once a miss being answered is done (a few microseconds). */
static void loop_busy(Ring *r)
{
    int idle = LOOP_IDLE;
    while (!__atomic_compare_exchange_n(&r->index_state, &idle, LOOP_BUSY, 0, __ATOMIC_ACQUIRE,
                                        __ATOMIC_RELAXED)) {
        idle = LOOP_IDLE;
        sched_yield();
    }
}

static struct entry *pop(Ring *r)
{
    pthread_mutex_lock(&r->handoff_lock);
    struct entry *e = r->handoff;
    if (e) {
        r->handoff = e->next;
        if (r->handoff == NULL)
            r->handoff_tail = NULL;
    }
    pthread_mutex_unlock(&r->handoff_lock);
    return e;
}

/* take(buffer, spin_ns) -> size, or -errno: the next request handed over, into buffer as
 * /dev/fuse delivers it; spinning up to spin_ns for one (the index's lock let go meanwhile).
 * -EAGAIN: none came (wait for the loop's eventfd, `fileno()`); -ENODEV: a queue is gone. */
static PyObject *ring_take(Ring *r, PyObject *args)
{
    Py_buffer buffer;
    long long spin_ns;
    if (!PyArg_ParseTuple(args, "w*L", &buffer, &spin_ns))
        return NULL;
    if (r->closed) {
        PyBuffer_Release(&buffer);
        return PyLong_FromLong(-ENODEV);
    }
    __atomic_store_n(&r->loop_sleeping, 0, __ATOMIC_SEQ_CST);
    struct entry *e = pop(r);
    if (e == NULL && spin_ns > 0) {
        Py_BEGIN_ALLOW_THREADS
        __atomic_store_n(&r->index_state, LOOP_IDLE, __ATOMIC_RELEASE);
        long long until = now_ns() + spin_ns;
        while ((e = pop(r)) == NULL && now_ns() < until &&
               __atomic_load_n(&r->queues_done, __ATOMIC_ACQUIRE) == 0)
            ;
        loop_busy(r);
        Py_END_ALLOW_THREADS
    }
    if (e == NULL) { /* say we sleep, then look once more: no hand-over goes unannounced */
        __atomic_store_n(&r->loop_sleeping, 1, __ATOMIC_SEQ_CST);
        e = pop(r);
        if (e != NULL)
            __atomic_store_n(&r->loop_sleeping, 0, __ATOMIC_SEQ_CST);
    }
    if (e == NULL) {
        PyBuffer_Release(&buffer);
        /* one queue gone is the end: its CPU's callers would wait on it for ever */
        int done = __atomic_load_n(&r->queues_done, __ATOMIC_ACQUIRE) > 0;
        return PyLong_FromLong(done ? -ENODEV : -EAGAIN);
    }
    struct in_header in;
    memcpy(&in, e->header->in_out, sizeof in);
    size_t own = in.opcode < 64 ? r->arg0[in.opcode] : 0;
    size_t payload = e->header->ent.payload_sz;
    size_t size = sizeof in + own + payload;
    if (payload > r->payload_size || size > (size_t)buffer.len) { /* cannot be: say so */
        PyBuffer_Release(&buffer);
        PyErr_Format(PyExc_OSError, "a ring request of %zu bytes", size);
        return NULL;
    }
    in.len = (uint32_t)size;
    char *out = buffer.buf;
    memcpy(out, &in, sizeof in);
    memcpy(out + sizeof in, e->header->op_in, own);
    memcpy(out + sizeof in + own, e->payload, payload);
    e->unique = in.unique;
    e->state = WITH_LOOP;
    PyBuffer_Release(&buffer);
    return PyLong_FromSize_t(size);
}

/* reply(parts) -> bool: where the answer (a fuse_out_header, then its arguments, in parts) is
 * to a request taken here, hand it to its queue's thread to commit; False where it is not
 * (it came on /dev/fuse: write it there). */
static PyObject *ring_reply(Ring *r, PyObject *parts)
{
    PyObject *seq = PySequence_Fast(parts, "reply takes a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    struct out_header out;
    Py_buffer first;
    if (n < 1 || PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, 0), &first, PyBUF_SIMPLE) < 0) {
        Py_DECREF(seq);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "a reply starts with its header");
        return NULL;
    }
    int short_header = first.len < (Py_ssize_t)sizeof out;
    if (!short_header)
        memcpy(&out, first.buf, sizeof out);
    PyBuffer_Release(&first);
    if (short_header) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "a reply starts with its header");
        return NULL;
    }
    struct entry *e = NULL;
    for (int i = 0; i < r->queues && e == NULL && !r->closed; i++)
        for (int j = 0; j < r->entries; j++) {
            struct entry *c = &r->queue[i].entries[j];
            if (c->state == WITH_LOOP && c->unique == out.unique) {
                e = c;
                break;
            }
        }
    if (e == NULL) {
        Py_DECREF(seq);
        Py_RETURN_FALSE;
    }
    size_t at = 0, skip = sizeof out; /* the header's bytes go to in_out, the rest to payload */
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer part;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(seq, i), &part, PyBUF_SIMPLE) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        size_t from = skip < (size_t)part.len ? skip : (size_t)part.len;
        skip -= from;
        size_t size = (size_t)part.len - from;
        if (at + size > r->payload_size) { /* larger than the kernel may take: fail it */
            out.error = -EIO;
            at = 0;
            PyBuffer_Release(&part);
            break;
        }
        memcpy(e->payload + at, (char *)part.buf + from, size);
        at += size;
        PyBuffer_Release(&part);
    }
    Py_DECREF(seq);
    out.len = (uint32_t)(sizeof out + at);
    memcpy(e->header->in_out, &out, sizeof out);
    e->header->ent.payload_sz = (uint32_t)at;
    struct queue *q = e->queue;
    e->state = ANSWERED;
    pthread_mutex_lock(&q->lock);
    e->next = q->commits;
    q->commits = e;
    pthread_mutex_unlock(&q->lock);
    wake(q->wake_fd);
    Py_RETURN_TRUE;
}

/* idle(): the loop is about to wait (trio's I/O wait): misses may be answered meanwhile.
 * busy(): it runs again. */
static PyObject *ring_idle(Ring *r, PyObject *Py_UNUSED(ignored))
{
    __atomic_store_n(&r->index_state, LOOP_IDLE, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

static PyObject *ring_busy(Ring *r, PyObject *Py_UNUSED(ignored))
{
    Py_BEGIN_ALLOW_THREADS /* a queue's thread takes the index, then the GIL: the same order */
    loop_busy(r);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* answered() -> list of nanoseconds: the misses answered on the queues' threads since the
 * last call, each the time it took before its commit. */
static PyObject *ring_answered(Ring *r, PyObject *Py_UNUSED(ignored))
{
    PyObject *list = PyList_New(r->misses); /* (the loop is busy: no queue adds now) */
    if (list == NULL)
        return NULL;
    for (int i = 0; i < r->misses; i++) {
        PyObject *ns = PyLong_FromLongLong(r->missed_ns[i]);
        if (ns == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, ns);
    }
    r->misses = 0;
    return list;
}

/* errors() -> the first failure each queue's thread met (0: none), for the log. */
static PyObject *ring_errors(Ring *r, PyObject *Py_UNUSED(ignored))
{
    PyObject *list = PyList_New(r->closed ? 0 : r->queues);
    for (int i = 0; list && !r->closed && i < r->queues; i++)
        PyList_SET_ITEM(list, i, PyLong_FromLong(__atomic_load_n(&r->queue[i].error, __ATOMIC_ACQUIRE)));
    return list;
}

static PyObject *ring_fileno(Ring *r, PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(r->loop_fd);
}

static PyMethodDef ring_methods[] = {
    {"take", (PyCFunction)ring_take, METH_VARARGS, "The next request handed over, or -errno."},
    {"reply", (PyCFunction)ring_reply, METH_O, "Commit an answer to a request taken here."},
    {"fast_misses", (PyCFunction)ring_fast_misses, METH_VARARGS, "Answer misses from dirs."},
    {"idle", (PyCFunction)ring_idle, METH_NOARGS, "The loop waits: misses may be answered."},
    {"busy", (PyCFunction)ring_busy, METH_NOARGS, "The loop runs again."},
    {"answered", (PyCFunction)ring_answered, METH_NOARGS, "Misses answered since, in ns."},
    {"errors", (PyCFunction)ring_errors, METH_NOARGS, "Each queue's first failure (errno)."},
    {"fileno", (PyCFunction)ring_fileno, METH_NOARGS, "The eventfd the loop waits on."},
    {"close", (PyCFunction)ring_close, METH_NOARGS, "Stop the queues and free the rings."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvfs.mount._ring.Ring",
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One FUSE connection's io_uring queues (mount/ring.py).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_ring",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__ring(void)
{
    if (PyType_Ready(&RingType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&RingType);
    if (PyModule_AddObject(m, "Ring", (PyObject *)&RingType) < 0) {
        Py_DECREF(&RingType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
