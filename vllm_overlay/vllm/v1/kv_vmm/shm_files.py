# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Files that engines of one user (or of one group) share in ``/dev/shm``.

``/dev/shm`` is writable by every user of the host, so nothing there is
trusted by name. The engines' files live in a directory of their own
(:func:`shared_dir`): ``vllm-kv-u<uid>`` (mode 0700, the engines of one
user) or, with ``--kv-cache-vmm-shared-group``, ``vllm-kv-g<gid>`` (mode
2770, group ``gid``, engines of several users). It is made under a
temporary name and renamed into place once its owner and mode are right,
and whoever finds it checks it (``lstat``: a directory, not a symlink, the
right owner or group, nobody else may write it) before using anything in
it. Files in it are created exclusively (``O_EXCL | O_NOFOLLOW``) with the
same owner-only (or group) mode and checked again when opened; files that
change are replaced whole (:func:`replace_file`: a new file renamed over
the old one), so a reader never sees half a write.

Liveness (:func:`process_token`, :func:`token_alive`): each process that
owns something in the directory (a ledger entry, a measurement, a page
report) holds an exclusive ``flock`` on a lock file of its own,
``vllm-kv-proc-<token>.lock``, for as long as it lives. The kernel drops
the lock when the process dies, however it dies, so whoever can take the
lock knows the owner is gone: this holds across PID namespaces
(containers sharing ``/dev/shm``), where pids and ``/proc`` do not.
"""

import atexit
import contextlib
import errno
import fcntl
import grp
import os
import stat
import threading
import uuid
from dataclasses import dataclass

from vllm.v1.kv_cache_compat import kv_vmm_shm_base

_DIR_PREFIX = "vllm-kv-"
_TOKEN_PREFIX = "vllm-kv-proc-"
_TOKEN_SUFFIX = ".lock"
_TOKEN_LEN = 32  # uuid4().hex


class SharedFileError(RuntimeError):
    """A shared file or directory that is unsafe or unreadable; the message
    names it, the problem and the fix, in one line."""


@dataclass(frozen=True)
class FileOwner:
    """Who the engines' files belong to: one user (``gid`` None: owner-only
    files) or one group (files readable and writable by the group)."""

    uid: int
    gid: int | None = None

    @property
    def dir_name(self) -> str:
        if self.gid is None:
            return f"{_DIR_PREFIX}u{self.uid}"
        return f"{_DIR_PREFIX}g{self.gid}"

    @property
    def file_mode(self) -> int:
        return 0o600 if self.gid is None else 0o660

    @property
    def dir_mode(self) -> int:
        # setgid: files made in it get the group.
        return 0o700 if self.gid is None else 0o2770

    def describe(self) -> str:
        if self.gid is None:
            return f"user {_user_name(self.uid)}"
        return f"group {_group_name(self.gid)}"


def _user_name(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _group_name(gid: int) -> str:
    try:
        return f"{grp.getgrgid(gid).gr_name} (gid {gid})"
    except KeyError:
        return f"gid {gid}"


def resolve_group(group: str | None) -> int | None:
    """The gid of ``--kv-cache-vmm-shared-group`` (a name or a number)."""
    if group is None:
        return None
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ValueError(
            f"--kv-cache-vmm-shared-group {group!r}: no such group on this host "
            "(give a group name from /etc/group or a numeric gid)"
        ) from None


def file_owner(group: str | None = None, uid: int | None = None) -> FileOwner:
    """The owner of this process's shared files: its effective uid, or the
    shared group. ``uid``: another user's files (root managing them)."""
    return FileOwner(os.geteuid() if uid is None else uid, resolve_group(group))


def base_dir(base: str | None = None) -> str:
    """Where the per-owner directories live: ``base``, else
    ``VLLM_KV_VMM_LEDGER_DIR`` (read now, not at import), ``/dev/shm``."""
    return base or kv_vmm_shm_base()


def dir_path(owner: FileOwner, base: str | None = None) -> str:
    return os.path.join(base_dir(base), owner.dir_name)


def _describe_mode(st: os.stat_result) -> str:
    return (
        f"owned by {_user_name(st.st_uid)}, group {_group_name(st.st_gid)}, "
        f"mode {stat.S_IMODE(st.st_mode):04o}"
    )


def _owner_problem(
    st: os.stat_result, owner: FileOwner, expected_mode: int, group_needs: int = 0
) -> str | None:
    """Why ``owner`` is not the only one who may use the file or directory
    ``st`` describes (None if it is): without a shared group only its user
    may, with one only that group (which needs at least ``group_needs``).
    Directories and files follow the same rule, so a refusal of either reads
    the same; ``expected_mode`` is the mode the engines make it with."""
    mode = stat.S_IMODE(st.st_mode)
    if owner.gid is None:
        if st.st_uid != owner.uid or mode & 0o077:
            return (
                f"is {_describe_mode(st)}, not {owner.describe()} "
                f"with mode {expected_mode:04o}"
            )
    elif st.st_gid != owner.gid or mode & 0o007 or mode & group_needs != group_needs:
        return (
            f"is {_describe_mode(st)}, not group {_group_name(owner.gid)} "
            f"with mode {expected_mode:04o}"
        )
    return None


def _dir_problem(st: os.stat_result, owner: FileOwner) -> str | None:
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    # The group must be able to make and remove the owner's files in it.
    return _owner_problem(st, owner, owner.dir_mode, group_needs=0o070)


def check_dir(path: str, owner: FileOwner) -> None:
    """Refuse a directory another user could have made or may write."""
    st = os.lstat(path)
    problem = _dir_problem(st, owner)
    if problem is not None:
        raise SharedFileError(
            f"KV memory ledger directory {path} {problem}: another user may "
            f"have made it; remove it (rm -r {path}) and start again, or set "
            "VLLM_KV_VMM_LEDGER_DIR to a directory of your own"
        )


def _check_base(base: str) -> None:
    try:
        st = os.stat(base)
    except FileNotFoundError:
        raise SharedFileError(
            f"KV memory ledger base directory {base} does not exist; create it "
            "or set VLLM_KV_VMM_LEDGER_DIR to an existing directory"
        ) from None
    mode = stat.S_IMODE(st.st_mode)
    trusted_owner = st.st_uid in (0, os.geteuid())
    if (
        not stat.S_ISDIR(st.st_mode)
        or not trusted_owner
        or (mode & 0o022 and not mode & stat.S_ISVTX)
    ):
        raise SharedFileError(
            f"KV memory ledger base directory {base} is {_describe_mode(st)}: "
            "it must be a directory of root or of this user that others may "
            "not write, or sticky like /dev/shm (another user could replace "
            "the engines' directory in it); set VLLM_KV_VMM_LEDGER_DIR to "
            "such a directory"
        )


def shared_dir(owner: FileOwner, base: str | None = None, create: bool = True) -> str:
    """The owner's directory under the base directory, made if missing
    (``create``) and checked; raises :class:`SharedFileError` if it is
    unsafe, FileNotFoundError if it is missing and not ``create``."""
    base = base_dir(base)
    path = os.path.join(base, owner.dir_name)
    if not create and not os.path.lexists(path):
        raise FileNotFoundError(errno.ENOENT, "no such directory", path)
    _check_base(base)
    try:
        check_dir(path, owner)
        return path
    except FileNotFoundError:
        if not create:
            raise
    # Made under a temporary name with its final owner and mode, then renamed
    # into place: nobody ever sees it half made.
    tmp = os.path.join(base, f".{owner.dir_name}.{uuid.uuid4().hex}")
    os.mkdir(tmp, 0o700)
    try:
        if owner.gid is not None:
            try:
                os.chown(tmp, -1, owner.gid)
            except PermissionError:
                raise SharedFileError(
                    f"cannot give {tmp} to group {_group_name(owner.gid)}: this "
                    "user is not a member of it; add the user to the group "
                    "or give --kv-cache-vmm-shared-group a group it is in"
                ) from None
        if owner.uid != os.geteuid():
            os.chown(tmp, owner.uid, -1)
        os.chmod(tmp, owner.dir_mode)
        try:
            os.rename(tmp, path)
        except OSError as e:
            # Made meanwhile by another engine (a non-empty directory, or one
            # of another user in a sticky base): use that one.
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.EPERM):
                raise
    finally:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(tmp)
    check_dir(path, owner)
    return path


def _file_problem(st: os.stat_result, owner: FileOwner) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} hard links"
    return _owner_problem(st, owner, owner.file_mode)


def open_file(
    path: str,
    owner: FileOwner,
    flags: int = os.O_RDWR,
    what: str = "KV memory ledger file",
) -> int:
    """Open an existing shared file, checked (not a symlink, the owner's,
    nobody else may write it); FileNotFoundError if there is none."""
    try:
        # O_NONBLOCK: a FIFO put in the file's place would block the open
        # until a writer comes; it is refused below like any non-file.
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise SharedFileError(
                f"{what} {path} is a symbolic link: another user may have "
                f"made it; remove it (rm {path}); the engines re-create it"
            ) from None
        if e.errno == errno.EACCES:
            raise SharedFileError(
                f"{what} {path} cannot be opened by {_user_name(os.geteuid())}; "
                "engines of several users share a device with "
                "--kv-cache-vmm-shared-group"
            ) from None
        raise
    try:
        problem = _file_problem(os.fstat(fd), owner)
    except BaseException:
        os.close(fd)
        raise
    if problem is not None:
        os.close(fd)
        raise SharedFileError(
            f"{what} {path} {problem}: another user may have made it; "
            f"remove it (rm {path}); the engines re-create it"
        )
    return fd


def create_file(path: str, owner: FileOwner) -> int:
    """Create a shared file exclusively (FileExistsError if it exists),
    with the owner's mode whatever the umask; returns an fd open for
    reading and writing."""
    fd = os.open(
        path,
        os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        owner.file_mode,
    )
    try:
        if owner.gid is not None:
            os.fchown(fd, -1, owner.gid)
        if owner.uid != os.geteuid() and owner.gid is None:
            # Root managing another user's files: they stay that user's.
            os.fchown(fd, owner.uid, -1)
        os.fchmod(fd, owner.file_mode)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return fd


def open_or_create(path: str, owner: FileOwner) -> int:
    """An fd of the shared file at ``path``, created if missing."""
    while True:
        try:
            return create_file(path, owner)
        except FileExistsError:
            pass
        try:
            return open_file(path, owner)
        except FileNotFoundError:
            continue  # removed meanwhile: create it


def read_file(path: str, owner: FileOwner, limit: int) -> bytes | None:
    """The whole content of a shared file (None if there is none); a file
    larger than ``limit`` bytes raises :class:`SharedFileError`."""
    try:
        fd = open_file(path, owner, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        chunks: list[bytes] = []
        size = 0
        while size <= limit and (chunk := os.read(fd, 1 << 16)):
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > limit:
        raise SharedFileError(
            f"KV memory ledger {path} is not valid: larger than {limit} bytes; "
            f"remove it (rm {path}); the engines sharing the device re-create it"
        )
    return b"".join(chunks)


def replace_file(path: str, data: bytes, owner: FileOwner) -> None:
    """Replace the file at ``path`` with ``data`` at once: a new file in
    the same directory, renamed over it (callers serialize writers)."""
    tmp = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = create_file(tmp, owner)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    os.close(fd)
    try:
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# -- liveness -----------------------------------------------------------------

_tokens_lock = threading.Lock()
#: directory -> (token, fd holding the flock) of this process.
_tokens: dict[str, tuple[str, int]] = {}
#: Files this process made that carry its token (removed at a clean exit).
_owned_files: set[str] = set()
_tokens_pid = os.getpid()


def _token_path(directory: str, token: str) -> str:
    return os.path.join(directory, f"{_TOKEN_PREFIX}{token}{_TOKEN_SUFFIX}")


def process_token(directory: str, owner: FileOwner) -> str:
    """This process's liveness token in ``directory``: the name of a lock
    file it holds an exclusive ``flock`` on until it exits."""
    with _tokens_lock:
        held = _tokens.get(directory)
        if held is not None:
            return held[0]
        while True:
            token = uuid.uuid4().hex
            path = _token_path(directory, token)
            fd = create_file(path, owner)
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A sweep may have taken the file for a dead process's before it
            # was locked (and removed it): then try another.
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        _tokens[directory] = (token, fd)
        return token


def own_file(path: str) -> None:
    """Remove ``path`` (a file carrying this process's token) at exit."""
    with _tokens_lock:
        _owned_files.add(path)


def disown_file(path: str) -> None:
    with _tokens_lock:
        _owned_files.discard(path)


def token_alive(directory: str, token: str) -> bool:
    """Whether the process of ``token`` lives: its lock file exists and is
    locked. A dead process's lock file is removed."""
    path = _token_path(directory, token)
    try:
        # O_NONBLOCK: a FIFO of that name does not block the open (no live
        # process holds a flock on it: it is removed as a dead one's).
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP):
            return False
        raise
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        # Removed while locked: a process making this file waits for the
        # lock, then finds it gone and makes another (process_token).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)


def is_token(text: str) -> bool:
    return len(text) == _TOKEN_LEN and all(c in "0123456789abcdef" for c in text)


def sweep_tokens(directory: str) -> None:
    """Remove the lock files of processes that died (those left when a
    process that had left every ledger was killed)."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(directory):
            if name.startswith(_TOKEN_PREFIX) and name.endswith(_TOKEN_SUFFIX):
                token = name[len(_TOKEN_PREFIX) : -len(_TOKEN_SUFFIX)]
                if is_token(token):
                    token_alive(directory, token)


def _release_at_exit() -> None:
    if os.getpid() != _tokens_pid:
        return
    with _tokens_lock:
        for path in _owned_files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        _owned_files.clear()
        for directory, (token, fd) in _tokens.items():
            with contextlib.suppress(OSError):
                os.unlink(_token_path(directory, token))
            os.close(fd)
        _tokens.clear()


def _forget_in_child() -> None:
    # A forked child must not keep its parent's locks alive after the parent
    # died (the flock belongs to the open file, which the child shares), nor
    # remove the parent's files at its own exit.
    global _tokens_lock, _tokens_pid
    _tokens_lock = threading.Lock()
    _tokens_pid = os.getpid()
    for _, fd in _tokens.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    _tokens.clear()
    _owned_files.clear()


atexit.register(_release_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)
