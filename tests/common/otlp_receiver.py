#!/usr/bin/env python3
"""An OTLP/HTTP trace receiver for the tests (tests/common/otlp.rs starts it).

Takes `POST /v1/traces` with an `ExportTraceServiceRequest` in protobuf, decodes it with
PyPI `opentelemetry-proto` (a decoder redisched's authors did not write), and prints one
JSON object per span on stdout; the first line is `listening <port>`. A request it cannot
take (another path or content type, a body that does not decode) is answered 400/404/415
and printed as `{"error": ...}`, so a test sees it. `bash scripts/otel-deps.sh` installs
the decoder.
"""
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

KINDS = {0: "unspecified", 1: "internal", 2: "server", 3: "client", 4: "producer", 5: "consumer"}
STATUS = {0: "unset", 1: "ok", 2: "error"}


def value(any_value):
    which = any_value.WhichOneof("value")
    if which is None:
        return None
    if which == "array_value":
        return [value(v) for v in any_value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: value(kv.value) for kv in any_value.kvlist_value.values}
    if which == "bytes_value":
        return any_value.bytes_value.hex()
    return getattr(any_value, which)


def attributes(pairs):
    return {kv.key: value(kv.value) for kv in pairs}


def emit(line):
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


class Handler(BaseHTTPRequestHandler):
    def refuse(self, status, error):
        emit({"error": error, "path": self.path})
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        if self.path != "/v1/traces":
            return self.refuse(404, "not the traces path")
        content_type = self.headers.get("Content-Type", "")
        if content_type != "application/x-protobuf":
            return self.refuse(415, "content type " + content_type)
        request = ExportTraceServiceRequest()
        try:
            request.ParseFromString(body)
        except Exception as err:  # the bytes did not decode: the test must see it
            return self.refuse(400, "undecodable: %s" % err)
        for resource_spans in request.resource_spans:
            resource = attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    emit({
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "name": span.name,
                        "kind": KINDS.get(span.kind, str(span.kind)),
                        "start_ns": span.start_time_unix_nano,
                        "end_ns": span.end_time_unix_nano,
                        "attributes": attributes(span.attributes),
                        "links": [
                            {"trace_id": l.trace_id.hex(), "span_id": l.span_id.hex()}
                            for l in span.links
                        ],
                        "status": {"code": STATUS.get(span.status.code), "message": span.status.message},
                        "scope": scope_spans.scope.name,
                        "resource": resource,
                    })
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
sys.stdout.write("listening %d\n" % server.server_port)
sys.stdout.flush()
server.serve_forever()
