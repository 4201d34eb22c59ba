/* The least any FUSE daemon can do for a lookup when the kernel hands requests over
 * FUSE-over-io_uring (Linux 6.14+, fuse.enable_uring=Y), for tools/bench_mount.py to measure
 * beside tools/fuse_floor.c (libfuse reading /dev/fuse). The kernel keeps one request queue per
 * CPU and queues a request on the CPU its caller runs on; here one thread per CPU, pinned there,
 * serves that queue, so a request and its answer never cross CPUs. Names as in fuse_floor.c:
 * in the root, those starting with 'h' exist, every other one does not (a negative entry).
 * No libfuse (3.14 cannot ask for io_uring) and no liburing: raw syscalls, root only.
 * Usage: fuse_uring_floor MOUNTPOINT (exits 3 where the kernel does not offer io_uring). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/fuse.h>
#include <linux/io_uring.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

/* From the kernel's include/uapi/linux/fuse.h (7.42+), newer than the installed headers. */
#define OVER_IO_URING_FLAG2 (1u << 9) /* FUSE_OVER_IO_URING: bit 41 of the 64 init flags */
#define CMD_REGISTER 1                /* FUSE_IO_URING_CMD_REGISTER */
#define CMD_COMMIT_AND_FETCH 2        /* FUSE_IO_URING_CMD_COMMIT_AND_FETCH */
struct ent_in_out { uint64_t flags, commit_id; uint32_t payload_sz, padding; uint64_t reserved; };
struct ring_header { char in_out[128]; char op_in[128]; struct ent_in_out ent; };
struct cmd_req { uint64_t flags, commit_id; uint16_t qid; uint8_t padding[6]; };

#define MAX_WRITE (128u << 10) /* the ring's payload buffers must hold this much */
#define SQE_SIZE 128           /* IORING_SETUP_SQE128: the fuse command needs the long form */

static int dev_fd;
static uint64_t next_ino = 2;

static void attr_of(uint64_t ino, struct fuse_attr *attr) {
    memset(attr, 0, sizeof *attr);
    attr->ino = ino;
    attr->mode = ino == FUSE_ROOT_ID ? S_IFDIR | 0755 : S_IFREG | 0644;
    attr->nlink = 1;
    attr->size = ino == FUSE_ROOT_ID ? 0 : 2 << 20;
}

/* The answer's argument bytes into out, their size returned; *error 0 or -errno. */
static size_t answer(const struct fuse_in_header *in, const char *name, char *out, int *error) {
    *error = 0;
    if (in->opcode == FUSE_LOOKUP) {
        struct fuse_entry_out *entry = (void *)out;
        memset(entry, 0, sizeof *entry);
        entry->entry_valid = entry->attr_valid = 3600;
        if (in->nodeid == FUSE_ROOT_ID && name[0] == 'h') {
            entry->nodeid = __atomic_fetch_add(&next_ino, 1, __ATOMIC_RELAXED);
            attr_of(entry->nodeid, &entry->attr);
        } /* else nodeid 0: a negative entry the kernel keeps for entry_valid */
        return sizeof *entry;
    }
    if (in->opcode == FUSE_GETATTR) {
        struct fuse_attr_out *attr = (void *)out;
        memset(attr, 0, sizeof *attr);
        attr->attr_valid = 3600;
        attr_of(in->nodeid, &attr->attr);
        return sizeof *attr;
    }
    *error = -ENOSYS;
    return 0;
}

struct ring {
    int fd;
    unsigned *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
    char *sqes;
    struct io_uring_cqe *cqes;
};

static int ring_setup(struct ring *r) {
    struct io_uring_params p = {.flags = IORING_SETUP_SQE128};
    r->fd = syscall(__NR_io_uring_setup, 2, &p);
    if (r->fd < 0)
        return -errno;
    size_t sq_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    size_t cq_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    /* one mapping for both rings (IORING_FEAT_SINGLE_MMAP, older than fuse's io_uring) */
    char *rings = mmap(NULL, sq_size > cq_size ? sq_size : cq_size, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQ_RING);
    r->sqes = mmap(NULL, p.sq_entries * SQE_SIZE, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_POPULATE, r->fd, IORING_OFF_SQES);
    if (rings == MAP_FAILED || r->sqes == MAP_FAILED)
        return -errno;
    r->sq_tail = (void *)(rings + p.sq_off.tail);
    r->sq_mask = (void *)(rings + p.sq_off.ring_mask);
    r->sq_array = (void *)(rings + p.sq_off.array);
    r->cq_head = (void *)(rings + p.cq_off.head);
    r->cq_tail = (void *)(rings + p.cq_off.tail);
    r->cq_mask = (void *)(rings + p.cq_off.ring_mask);
    r->cqes = (void *)(rings + p.cq_off.cqes);
    return 0;
}

/* Send one fuse command (register, or commit an answer and fetch) and wait for the next
 * request on this entry: the completion's result (0, or -errno). */
static int command(struct ring *r, int op, struct iovec *iov, uint64_t commit_id, int qid) {
    unsigned tail = *r->sq_tail, slot = tail & *r->sq_mask;
    struct io_uring_sqe *sqe = (void *)(r->sqes + slot * SQE_SIZE);
    memset(sqe, 0, SQE_SIZE);
    sqe->opcode = IORING_OP_URING_CMD;
    sqe->fd = dev_fd;
    sqe->cmd_op = op;
    sqe->addr = (uintptr_t)iov;
    sqe->len = 2; /* the header buffer and the payload buffer */
    struct cmd_req *req = (void *)sqe->cmd;
    req->commit_id = commit_id;
    req->qid = qid;
    r->sq_array[slot] = slot;
    __atomic_store_n(r->sq_tail, tail + 1, __ATOMIC_RELEASE);
    unsigned to_submit = 1;
    for (;;) {
        int n = syscall(__NR_io_uring_enter, r->fd, to_submit, 1, IORING_ENTER_GETEVENTS, NULL, 0);
        if (n < 0 && errno != EINTR)
            return -errno;
        if (n > 0)
            to_submit = 0;
        unsigned head = *r->cq_head;
        if (head != __atomic_load_n(r->cq_tail, __ATOMIC_ACQUIRE)) {
            int res = r->cqes[head & *r->cq_mask].res;
            __atomic_store_n(r->cq_head, head + 1, __ATOMIC_RELEASE);
            return res;
        }
    }
}

static void *serve_queue(void *arg) {
    int qid = (int)(intptr_t)arg;
    cpu_set_t cpu;
    CPU_ZERO(&cpu);
    CPU_SET(qid, &cpu);
    pthread_setaffinity_np(pthread_self(), sizeof cpu, &cpu);
    struct ring r;
    struct ring_header *header = aligned_alloc(4096, 4096);
    char *payload = aligned_alloc(4096, MAX_WRITE);
    int err = header && payload ? ring_setup(&r) : -ENOMEM;
    if (err) {
        fprintf(stderr, "queue %d: %s\n", qid, strerror(-err));
        exit(1);
    }
    struct iovec iov[2] = {{header, sizeof *header}, {payload, MAX_WRITE}};
    int op = CMD_REGISTER;
    uint64_t commit_id = 0;
    for (;;) {
        int res = command(&r, op, iov, commit_id, qid);
        if (res == -ENOTCONN || res == -ECANCELED) /* unmounted */
            exit(0);
        if (res < 0) {
            fprintf(stderr, "queue %d: %s\n", qid, strerror(-res));
            exit(1);
        }
        struct fuse_in_header in;
        memcpy(&in, header->in_out, sizeof in);
        char args[sizeof(struct fuse_entry_out)];
        int error;
        size_t size = answer(&in, payload, args, &error);
        memcpy(payload, args, size);
        struct fuse_out_header out = {sizeof out + size, error, in.unique};
        memcpy(header->in_out, &out, sizeof out);
        header->ent.payload_sz = size;
        commit_id = header->ent.commit_id;
        op = CMD_COMMIT_AND_FETCH;
    }
}

/* The kernel keeps a queue for every possible CPU and uses the ring once each has an entry. */
static int possible_cpus(void) {
    int first = 0, last = 0;
    FILE *f = fopen("/sys/devices/system/cpu/possible", "r");
    if (f == NULL || fscanf(f, "%d-%d", &first, &last) < 1)
        last = (int)sysconf(_SC_NPROCESSORS_CONF) - 1;
    if (f != NULL)
        fclose(f);
    return (last > first ? last : first) + 1;
}

int main(int argc, char *argv[]) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s MOUNTPOINT\n", argv[0]);
        return 2;
    }
    dev_fd = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    char options[128];
    snprintf(options, sizeof options, "fd=%d,rootmode=40000,user_id=0,group_id=0", dev_fd);
    if (dev_fd < 0 || mount("fuse_uring_floor", argv[1], "fuse.floor", MS_NOSUID | MS_NODEV, options)) {
        perror("mount");
        return 1;
    }
    static char request[MAX_WRITE + 4096];
    for (;;) { /* /dev/fuse: INIT, then forgets (never on the ring), then ENODEV at unmount */
        ssize_t got = read(dev_fd, request, sizeof request);
        if (got < 0) {
            if (errno == EINTR || errno == ENOENT)
                continue;
            return errno == ENODEV ? 0 : (perror("read"), 1);
        }
        const struct fuse_in_header *in = (void *)request;
        if (in->opcode == FUSE_FORGET || in->opcode == FUSE_BATCH_FORGET)
            continue;
        char reply[sizeof(struct fuse_out_header) + 2 * sizeof(struct fuse_entry_out)];
        struct fuse_out_header *out = (void *)reply;
        size_t size;
        int error = 0;
        if (in->opcode == FUSE_INIT) {
            const struct fuse_init_in *offer = (void *)(in + 1);
            if (!(offer->flags & FUSE_INIT_EXT) || !(offer->flags2 & OVER_IO_URING_FLAG2)) {
                fprintf(stderr, "the kernel does not offer io_uring (fuse.enable_uring=N?)\n");
                umount2(argv[1], MNT_DETACH);
                return 3;
            }
            struct fuse_init_out *init = (void *)(out + 1);
            *init = (struct fuse_init_out){
                .major = FUSE_KERNEL_VERSION, .minor = offer->minor,
                .max_readahead = offer->max_readahead, .flags = FUSE_INIT_EXT | FUSE_MAX_PAGES,
                .flags2 = OVER_IO_URING_FLAG2, .max_write = MAX_WRITE,
                .max_pages = MAX_WRITE / 4096, .max_background = 16, .congestion_threshold = 12};
            size = sizeof *init;
        } else { /* before every queue has registered, requests still come this way */
            size = answer(in, (const char *)(in + 1), (char *)(out + 1), &error);
        }
        *out = (struct fuse_out_header){sizeof *out + size, error, in->unique};
        if (write(dev_fd, reply, out->len) < 0)
            perror("write");
        if (in->opcode == FUSE_INIT) /* the kernel is initialized now: queues may register */
            for (int cpu = 0; cpu < possible_cpus(); cpu++) {
                pthread_t thread;
                pthread_create(&thread, NULL, serve_queue, (void *)(intptr_t)cpu);
            }
    }
}
