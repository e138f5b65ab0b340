"""The e2e tests that move an upstream's host name do it in /etc/hosts,
which getaddrinfo reads on every lookup: a line appended for the test (the
name carries the test's pid), changed in place to move the name, the file
cut back to its old length at the end. This needs root, as CI and the Quick
start have."""

import fcntl
import os

HOSTS = "/etc/hosts"
# Tests that edit /etc/hosts take turns (ctest runs this file twice at
# once, once per upstream client): each appends at the end and cuts back to
# the length it found.
HOSTS_LOCK = "/tmp/idemproxy-e2e-etc-hosts.lock"


class HostsEntry:
    """One line "127.0.0.N name" at the end of /etc/hosts, changed in place
    (one byte) so a concurrent reader never sees a half-written file."""

    def __init__(self, name):
        self.name = name
        self.orig_size = None
        self.digit_at = None

    def add(self, last_octet, *more):
        """The name on 127.0.0.<last_octet>, and on each of more (further
        lines, which getaddrinfo gives in this order); move() changes the
        first."""
        with open(HOSTS, "r+b") as f:
            data = f.read()
            self.orig_size = len(data)
            lead = b"" if data.endswith(b"\n") or not data else b"\n"
            lines = b"".join(b"127.0.0.%d %s\n" % (o, self.name.encode())
                             for o in (last_octet,) + more)
            f.write(lead + lines)
            self.digit_at = self.orig_size + len(lead) + len("127.0.0.")

    def move(self, last_octet):
        assert 0 <= last_octet <= 9
        fd = os.open(HOSTS, os.O_WRONLY)
        try:
            os.pwrite(fd, b"%d" % last_octet, self.digit_at)
        finally:
            os.close(fd)

    def remove(self):
        if self.orig_size is None:
            return
        with open(HOSTS, "r+b") as f:
            data = f.read()
            ours = data[self.orig_size:]
            if all(l.rstrip().endswith(b" " + self.name.encode())
                   for l in ours.strip().splitlines()):
                f.truncate(self.orig_size)
            else:  # not what we left: take out our line only
                keep = b"".join(l for l in data.splitlines(True)
                                if not l.rstrip().endswith(b" " + self.name.encode()))
                f.seek(0)
                f.write(keep)
                f.truncate(len(keep))
        self.orig_size = None


NAME_PREFIX = b"idemproxy-e2e-up-"


def remove_stale_entries():
    """Takes out the lines a killed run left (ctest's timeout kills without
    cleanup): names carry the pid of the test that added them. Called with
    the lock held."""
    def stale(line):
        words = line.split()
        if len(words) != 2 or not words[1].startswith(NAME_PREFIX):
            return False
        pid = words[1][len(NAME_PREFIX):].split(b"-")[0]
        if not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    with open(HOSTS, "r+b") as f:
        data = f.read()
        keep = b"".join(l for l in data.splitlines(True) if not stale(l))
        if keep != data:
            f.seek(0)
            f.write(keep)
            f.truncate(len(keep))


def entry_for(test, suffix):
    """Takes the /etc/hosts lock for the rest of test (a unittest.TestCase),
    clears lines killed runs left, and returns a HostsEntry that test's
    cleanup removes. Fails the test, rather than skipping it, without
    root."""
    if not os.access(HOSTS, os.W_OK):
        test.fail("this test edits %s to move a host name and needs root "
                  "(run the suite as CI does)" % HOSTS)
    lock = open(HOSTS_LOCK, "a")
    test.addCleanup(lock.close)  # (closing releases the lock)
    fcntl.flock(lock, fcntl.LOCK_EX)
    remove_stale_entries()
    entry = HostsEntry("%s%d-%s" % (NAME_PREFIX.decode(), os.getpid(), suffix))
    test.addCleanup(entry.remove)
    return entry
