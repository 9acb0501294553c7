"""`async with` for long-lived things that have an async `start()` and `close()`."""

from __future__ import annotations

from typing import Self


class AsyncLifetime:
    """Opens with `start()`, closes with `close()`; a start that fails is closed before the error goes up."""

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
