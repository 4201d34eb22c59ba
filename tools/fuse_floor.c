/* The least any FUSE daemon can do for a lookup, for tools/bench_mount.py to measure beside
 * kvfs: libfuse's single-threaded loop answering every LOOKUP from memory, with no I/O and no
 * bookkeeping. In the root, names starting with 'h' exist (a 2 MiB regular file each, a new
 * inode every time), every other name does not (a negative entry). Usage: fuse_floor MOUNTPOINT */
#define FUSE_USE_VERSION 34
#include <fuse_lowlevel.h>
#include <errno.h>
#include <string.h>
#include <stdlib.h>

static void attr_of(fuse_ino_t ino, struct stat *st) {
    memset(st, 0, sizeof *st);
    st->st_ino = ino;
    st->st_mode = ino == FUSE_ROOT_ID ? S_IFDIR | 0755 : S_IFREG | 0644;
    st->st_nlink = 1;
    st->st_size = ino == FUSE_ROOT_ID ? 0 : 2 << 20;
}

static void floor_lookup(fuse_req_t req, fuse_ino_t parent, const char *name) {
    struct fuse_entry_param e;
    memset(&e, 0, sizeof e);
    e.attr_timeout = e.entry_timeout = 3600.0;
    if (parent == FUSE_ROOT_ID && name[0] == 'h') {
        static fuse_ino_t next = 2;
        e.ino = next++;
        attr_of(e.ino, &e.attr);
    }  /* else ino 0: a negative entry the kernel keeps for entry_timeout */
    fuse_reply_entry(req, &e);
}

static void floor_getattr(fuse_req_t req, fuse_ino_t ino, struct fuse_file_info *fi) {
    struct stat st;
    (void)fi;
    attr_of(ino, &st);
    fuse_reply_attr(req, &st, 3600.0);
}

static const struct fuse_lowlevel_ops ops = {.lookup = floor_lookup, .getattr = floor_getattr};

int main(int argc, char *argv[]) {
    struct fuse_args args = FUSE_ARGS_INIT(argc - 1, argv);
    struct fuse_session *se = fuse_session_new(&args, &ops, sizeof ops, NULL);
    if (se == NULL || fuse_session_mount(se, argv[argc - 1]) != 0)
        return 1;
    int rc = fuse_session_loop(se);  /* one thread, as kvfs's receive loop */
    fuse_session_unmount(se);
    fuse_session_destroy(se);
    return rc;
}
