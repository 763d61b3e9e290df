"""`with kept():` around what lives as long as the process (a command's imports, a capture's session).

The cyclic collector runs every ~2 000 new container objects; importing a module makes hundreds
(functions, classes, dataclass methods), so a start-up that imports a few hundred modules runs
dozens of collections that find nothing to free (`record`'s warm run: ~45 collections, ~12 ms of
CPU, 175 objects freed in all). Inside `kept()` none runs, and what was made is frozen after
(`gc.freeze`), so no later collection walks it again. Reference counting still frees it.
"""

from __future__ import annotations

import gc


class kept:  # lower case: it reads as a statement, `with kept():`
    __slots__ = ("_was",)

    def __enter__(self) -> None:
        self._was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        gc.freeze()
        if self._was:
            gc.enable()
