"""werkzeug's test `Client` as the tests use it (`.text`, `.json`, `.status_code` on what it returns),
also on Debian 11's Werkzeug 1.0 (`make test-py39`), whose Client returns a tuple unless given a
response class and whose Response has neither `.text` nor `.json`. On Werkzeug 2+ it is theirs."""

from __future__ import annotations

import json
from typing import Any

from werkzeug import test as _test
from werkzeug.test import Client as _Client
from werkzeug.wrappers import Response

_WERKZEUG_2 = hasattr(_test, "TestResponse")  # its Client needs no response class


class _Response(Response):
    if not hasattr(Response, "text"):

        @property
        def text(self) -> str:
            return self.get_data(as_text=True)

    if not hasattr(Response, "json"):

        @property
        def json(self) -> Any:
            return json.loads(self.get_data()) if self.mimetype == "application/json" else None


class Client(_Client):
    def __init__(self, app: Any) -> None:
        if _WERKZEUG_2:
            super().__init__(app)
        else:
            super().__init__(app, _Response)
