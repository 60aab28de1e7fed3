"""What `ps`, `top` and `pgrep -f` show for the processes mooncaked starts itself.

A child of `--role all` is a `multiprocessing` spawn, so its command line reads
`python -c from multiprocessing.spawn import spawn_main ...`; a transfer I/O process reads
`python -m mooncaked.transfer.io_worker 18 20`. Neither says what it is or whose it is, so an
operator cannot tell which process to look at. These set a title that does (setproctitle: the
command line `ps` shows, and the 15-character name `top` shows). A daemon started by hand or by
systemd keeps its own command line: its flags are what an operator wants to see there.
"""

from __future__ import annotations

import os

import setproctitle


def set_child(role: str) -> None:
    """Title a process mooncaked started: `mooncaked ROLE (of pid PARENT)`. Only the pid: a title holding the
    parent's command line would match `pkill -f 'mooncaked --role all'` meant for the parent alone."""
    setproctitle.setproctitle(f"mooncaked {role} (of pid {os.getppid()})")


def name_known(role: str, name: str) -> None:
    """A child's instance name, once its server bound its port: `mooncaked ROLE NAME (of PARENT)`. A process
    set_child did not title keeps its own command line."""
    head = f"mooncaked {role} (of "
    title = setproctitle.getproctitle()
    if title.startswith(head):
        setproctitle.setproctitle(f"mooncaked {role} {name} (of {title[len(head):]}")
