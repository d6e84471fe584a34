"""Server interceptors wrap a method's handler in place: the same
(de)serializers around a new behaviour. One way to do it for all of them."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

#: inner handler function -> the wrapped one
Wrap = Callable[[Callable[..., Any]], Callable[..., Any]]


def rewrap(handler: Any, unary: Wrap, stream: Wrap, *, streaming_requests: bool = False) -> Any:
    """handler with its function wrapped: `unary` for methods answering one
    message, `stream` for those answering a stream. Methods whose requests
    are a stream are wrapped only if streaming_requests (else returned as
    they are)."""
    common = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **common)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(stream(handler.unary_stream), **common)
    if not streaming_requests:
        return handler
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **common)
    return grpc.stream_stream_rpc_method_handler(stream(handler.stream_stream), **common)


async def relay(result: Any) -> AsyncIterator[Any]:
    """The messages of a streaming handler's result: an async iterator, or
    a coroutine that writes them itself (context.write)."""
    if hasattr(result, "__aiter__"):
        async for item in result:
            yield item
    else:
        await result


class WrappingInterceptor(grpc.aio.ServerInterceptor):
    """An interceptor that wraps each method's handler: subclasses say how."""

    @abc.abstractmethod
    def wrap(self, handler: Any, method: str) -> Any:
        """handler with the subclass's behaviour around each call."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler: Any = await continuation(handler_call_details)
        if handler is None:
            return None
        return self.wrap(handler, handler_call_details.method)
