"""The runtime: the event-driven dispatcher that runs any bi-graph and owns blob storage."""

from purine.runtime.dispatcher import Dispatcher, TraceEvent

__all__ = ["Dispatcher", "TraceEvent"]
