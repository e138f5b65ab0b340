/*
 * hold_reader.c - opens an LMDB store's environment read-only, begins a read
 * transaction (taking a reader slot), prints "ready" and sleeps until it is
 * killed. test_stale_reader.py kills it with SIGKILL to leave the stale
 * reader slot that a crashed process leaves behind.
 *
 *   hold_reader STORE_DIR
 */
#include <lmdb.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    int rc;

    if (argc != 2) {
        fprintf(stderr, "usage: hold_reader STORE_DIR\n");
        return 2;
    }
    rc = mdb_env_create(&env);
    /* The store's own limits (store_lmdb.c), though an existing lock file
     * keeps the size it was made with. */
    if (rc == 0) {
        rc = mdb_env_set_maxdbs(env, 4);
    }
    if (rc == 0) {
        rc = mdb_env_set_maxreaders(env, 1024);
    }
    if (rc == 0) {
        rc = mdb_env_open(env, argv[1], MDB_RDONLY, 0600);
    }
    if (rc == 0) {
        rc = mdb_txn_begin(env, NULL, MDB_RDONLY, &txn);
    }
    if (rc != 0) {
        fprintf(stderr, "hold_reader: %s: %s\n", argv[1], mdb_strerror(rc));
        return 1;
    }
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        pause(); /* until SIGKILL: the read transaction is never ended */
    }
}
