"""Who may read the cache: this user only (the default), or one named group of service accounts.

A KV cache holds what users' prompts computed, and cached KV can be inverted back towards the prompt text,
so the cache must be as private as the prompts. By default the disk tier's chunk files are 0600, its
directories 0700 and the DRAM pool 0600, whatever the process's umask (modes are set with fchmod/chmod after
creation, since the umask can only take bits away and a umask of 000 would otherwise leave them as asked).

`share_group` names a group whose members share one cache on a node (several service accounts running
engines against one pool and one disk tier). Everything they share must then be group read-write where
they write it: the DRAM pool 0660 (every attached process updates pins and slot states in place), the
directories 2770 (members create, rename and evict chunk files; setgid so new files and subdirectories
inherit the group), and the chunk files 0640 (a committed chunk is never rewritten, only replaced by rename
or unlinked, both of which need the directory, not the file, to be writable).

Trust follows from the same setting: a file is the cache's own only if it was written by this user (or, when
shared, carries the group: only members and root can give a file that group), and nobody outside may write
it. Anything else found where a chunk or pool should be is foreign: never read, never removed.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


class PoolAccessError(PermissionError):
    """The DRAM pool's file belongs to someone this process must not share its KV with."""


def resolve_group(group: str | int) -> int:
    """The gid of a group given by name or number, checked to be one this process can give its files."""
    text = str(group).strip()
    if text.isdigit():
        gid = int(text)
    else:
        try:
            gid = grp.getgrnam(text).gr_gid
        except KeyError:
            raise ValueError(f"no group named {text!r} on this node") from None
    if os.geteuid() != 0 and gid != os.getegid() and gid not in os.getgroups():
        raise ValueError(f"this process (uid {os.geteuid()}) is not a member of group {text!r} (gid {gid})")
    return gid


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


@dataclass(frozen=True)
class FileAccess:
    """The modes, group and trust rule of the cache's files; `gid=None` keeps them private to this user."""

    gid: int | None = None

    @classmethod
    def for_group(cls, group: str | int | None) -> FileAccess:
        return cls(None if group is None else resolve_group(group))

    @property
    def shared(self) -> bool:
        return self.gid is not None

    @property
    def file_mode(self) -> int:
        return 0o640 if self.shared else 0o600

    @property
    def dir_mode(self) -> int:
        return 0o2770 if self.shared else 0o700

    @property
    def pool_mode(self) -> int:
        return 0o660 if self.shared else 0o600

    # ---- trust -------------------------------------------------------------------------------------------
    def _ours(self, st: os.stat_result) -> bool:
        return st.st_uid == os.geteuid() or (self.shared and st.st_gid == self.gid)

    def distrust(self, st: os.stat_result) -> str | None:
        """Why a file found in the cache is not the cache's own (None: it is), from its lstat.

        Private: written by this user and writable by nobody else. Shared: this user's or the group's, and not
        writable by users outside the group.
        """
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file"
        if not self._ours(st):
            whose = f"uid {st.st_uid}" + (f", group {st.st_gid}" if self.shared else "")
            return f"owned by {whose}, not by this user (uid {os.geteuid()})" + (
                f" nor group {self.gid}" if self.shared else ""
            )
        outsiders = stat.S_IWOTH if self.shared else stat.S_IWOTH | stat.S_IWGRP
        if st.st_mode & outsiders:
            return f"writable by other users (mode {_mode(st)})"
        return None

    # ---- files -------------------------------------------------------------------------------------------
    def set_fd(self, fd: int) -> None:
        """Give a file this process just created its exact mode and group, whatever the umask was."""
        os.fchmod(fd, self.file_mode)
        if self.shared:
            os.fchown(fd, -1, self.gid)

    def adopt_pool(self, fd: int, path: Path) -> None:
        """Check the DRAM pool file just opened is the cache's own, and give it this setting's mode and group.

        A pool file someone else owns, or one readable by users outside the setting that this user cannot
        tighten, is refused: every process that attaches writes its KV into those pages.
        """
        st = os.fstat(fd)
        if not self._ours(st):
            raise PoolAccessError(
                f"DRAM pool {path} is owned by uid {st.st_uid} (group {st.st_gid}), not by this user"
                f" (uid {os.geteuid()}){'' if not self.shared else f' nor group {self.gid}'}: its owner could read"
                f" every chunk written into it. Use another dram.pool_name, or set share_group to a group both"
                f" accounts are in and recreate the pool"
            )
        want = self.pool_mode
        if st.st_uid != os.geteuid():  # a group member's pool: usable if nobody outside the group can get at it
            if stat.S_IMODE(st.st_mode) & 0o007:
                raise PoolAccessError(f"DRAM pool {path} is open to every user (mode {_mode(st)}); its owner must"
                                      f" chmod o-rwx it, or remove it")  # fmt: skip
            return
        if stat.S_IMODE(st.st_mode) != want:
            if stat.S_IMODE(st.st_mode) & ~want:
                log.warning("DRAM pool %s was mode %s; tightened to %04o", path, _mode(st), want)
            os.fchmod(fd, want)
        if self.shared and st.st_gid != self.gid:
            os.fchown(fd, -1, self.gid)

    # ---- directories -------------------------------------------------------------------------------------
    def make_dir(self, path: Path) -> None:
        """Create one directory of the cache with exactly dir_mode (and the group); an existing one is kept."""
        try:
            os.mkdir(path, self.dir_mode & 0o777)
        except FileExistsError:
            return
        if self.shared:
            os.chown(path, -1, self.gid)
        os.chmod(path, self.dir_mode)  # after chown, which may clear setgid

    def enforce_dir(self, path: Path) -> str | None:
        """Bring an existing directory of the cache to dir_mode and the group where this user owns it.

        Returns what was done or found, for the caller to report: looser permissions on a directory this user
        owns are tightened; on one it does not own they are reported, since only the owner (or root) may
        change them.
        """
        st = os.stat(path)  # the tier's root may be a link to where the space is
        have, want = stat.S_IMODE(st.st_mode), self.dir_mode
        looser = have & 0o777 & ~want
        wrong_group = self.shared and st.st_gid != self.gid
        if have == want and not wrong_group:
            return None
        if st.st_uid != os.geteuid():
            if looser:
                return f"{path} is mode {have:04o}, looser than {want:04o}, and owned by uid {st.st_uid}: left as is"
            return None
        if wrong_group:
            os.chown(path, -1, self.gid)
        os.chmod(path, want)
        return f"{path} was mode {have:04o}; tightened to {want:04o}" if looser else None

    def tighten_file(self, path: Path, st: os.stat_result) -> bool:
        """Give one of this user's existing chunk files the exact file_mode and the group (files of older
        versions were 0755). True if it was looser."""
        have = stat.S_IMODE(st.st_mode)
        wrong_group = self.shared and st.st_gid != self.gid
        if st.st_uid != os.geteuid() or (have == self.file_mode and not wrong_group):
            return False
        with contextlib.suppress(FileNotFoundError):  # a regular file (distrust() checked), maybe evicted since
            if wrong_group:
                os.chown(path, -1, self.gid)
            os.chmod(path, self.file_mode)
        return bool(have & ~self.file_mode)


PRIVATE = FileAccess()
