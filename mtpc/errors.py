"""The one base class of errors caused by the user's input rather than by a bug: entry points
print them as one ``error: ...`` line and exit with status 2 (docs/TRAINING.md, "Errors and
startup checks")."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

USER_ERROR_EXIT_CODE = 2


class UserError(Exception):
    """A wrong setting, a missing or corrupt file, a draft for another target."""


class DraftError(UserError, ValueError):
    """An exported draft folder is missing, incomplete, corrupt or inconsistent."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist; the message names it and the fix."""


class DataError(UserError, ValueError):
    """A dataset or the data cache cannot be used; the message names the path."""


def run_reporting_user_errors(
    main: Callable[[], Any], also: tuple[type[BaseException], ...] = ()
) -> Any:
    """Calls ``main()``; a user error (or one of ``also``) becomes ``error: <message>`` on
    stderr and exit code 2, unless ``HYDRA_FULL_ERROR=1`` (then it propagates unchanged)."""
    caught: tuple[type[BaseException], ...] = (UserError, *also)
    try:
        return main()
    except caught as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(USER_ERROR_EXIT_CODE) from None
