"""Real OTLP trace receivers for tests, as a collector would run them: OTLP/gRPC (the
TraceService of opentelemetry-proto on a grpc server) and OTLP/HTTP (protobuf POSTed to
/v1/traces). Both decode what the exporters send into plain span records."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import SpanProcessor

from shoal.shared.embedded import free_port


@dataclass
class ReceivedSpan:
    name: str
    service: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, Any]
    start_ns: int
    end_ns: int


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Received:
    spans: list[ReceivedSpan] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in request.resource_spans:
                resource = {a.key: _value(a.value) for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans.append(ReceivedSpan(
                            name=s.name, service=resource.get("service.name", ""),
                            trace_id=s.trace_id.hex(), span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(), kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano))

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: set[str], timeout: float = 20) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.of_trace(trace_id)
            if names <= {s.name for s in spans}:
                return spans
            time.sleep(0.1)
        raise AssertionError(f"spans {names} of trace {trace_id} never arrived; got "
                             f"{[s.name for s in self.of_trace(trace_id)]}")


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """OTLP/gRPC on 127.0.0.1:<port>; endpoint() is for OTEL_EXPORTER_OTLP_TRACES_ENDPOINT."""

    def __init__(self) -> None:
        self.received = Received()
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - the generated service's method name
        self.received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(0)


class HttpReceiver:
    """OTLP/HTTP (protobuf) on http://127.0.0.1:<port>/v1/traces."""

    def __init__(self) -> None:
        self.received = received = Received()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = self.path == "/v1/traces" and \
                    self.headers.get("Content-Type") == "application/x-protobuf"
                if ok:
                    received.add(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 400)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Switchable(SpanProcessor):
    """Forwards to `inner` until closed: a test adds it to the process's provider, which has no
    way to remove a processor, and closes it when its receiver goes away."""

    def __init__(self, inner: SpanProcessor) -> None:
        self.inner: SpanProcessor | None = inner

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        if self.inner is not None:
            self.inner.on_start(span, parent_context)

    def on_end(self, span: Any) -> None:
        if self.inner is not None:
            self.inner.on_end(span)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis) if self.inner is not None else True

    def close(self) -> None:
        inner, self.inner = self.inner, None
        if inner is not None:
            inner.shutdown()
