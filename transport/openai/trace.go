package openai

import (
	"context"
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/kvrouter-ha/kvrouter-ha/routing"
)

// Tracing: with Config.Tracer set, each request is a span (the W3C traceparent of the client
// its parent), with children for its tokenization, its selection (the binding read
// included), each dispatch attempt (the prefill leg of a disaggregated one, the bind and its
// forward to the leader inside), and the worker gets the dispatch's traceparent. Without a
// tracer nothing is recorded and the client's traceparent goes to the worker as it came.

// tracerName names the front's tracer.
const tracerName = "github.com/kvrouter-ha/kvrouter-ha/transport/openai"

// Span attribute keys.
const (
	attrWorker    = attribute.Key("kvrouter.worker")
	attrRank      = attribute.Key("kvrouter.dp_rank")
	attrOverlap   = attribute.Key("kvrouter.overlap_blocks")
	attrPrompt    = attribute.Key("kvrouter.prompt_blocks")
	attrRevision  = attribute.Key("kvrouter.binding.revision")
	attrBound     = attribute.Key("kvrouter.bound")
	attrReplica   = attribute.Key("kvrouter.replica")
	attrAttempt   = attribute.Key("kvrouter.attempt")
	attrCause     = attribute.Key("kvrouter.failure.cause")
	attrKind      = attribute.Key("kvrouter.api")
	attrSession   = attribute.Key("kvrouter.session.present")
	attrTokens    = attribute.Key("kvrouter.prompt_tokens")
	attrStatus    = attribute.Key("http.response.status_code")
	attrPrefill   = attribute.Key("kvrouter.prefill_worker")
	attrFallback  = attribute.Key("kvrouter.tokenize.fallback")
	attrOutcome   = attribute.Key("kvrouter.disaggregation")
	attrGenerated = attribute.Key("kvrouter.output_tokens")
	attrMoves     = attribute.Key("kvrouter.migration.moves")
)

// tracing is the front's tracer and the W3C propagator; nil when tracing is off.
type tracing struct {
	tracer trace.Tracer
	prop   propagation.TraceContext
}

func newTracing(tp trace.TracerProvider) *tracing {
	if tp == nil {
		return nil
	}
	return &tracing{tracer: tp.Tracer(tracerName)}
}

// start starts a span under ctx's, or returns ctx and a span that records nothing when
// tracing is off.
func (t *tracing) start(ctx context.Context, name string, kind trace.SpanKind, attrs ...attribute.KeyValue) (context.Context, trace.Span) {
	if t == nil {
		return ctx, trace.SpanFromContext(context.Background())
	}
	return t.tracer.Start(ctx, name, trace.WithSpanKind(kind), trace.WithAttributes(attrs...))
}

// startRequest starts a request's span, its parent the client's traceparent, and returns
// the request carrying it.
func (t *tracing) startRequest(r *http.Request, kind Kind, replica string) (*http.Request, trace.Span) {
	if t == nil {
		return r, trace.SpanFromContext(context.Background())
	}
	ctx := t.prop.Extract(r.Context(), propagation.HeaderCarrier(r.Header))
	ctx, span := t.tracer.Start(ctx, r.Method+" "+r.URL.Path, trace.WithSpanKind(trace.SpanKindServer),
		trace.WithAttributes(attrKind.String(kind.String()), attrReplica.String(replica)))
	return r.WithContext(ctx), span
}

// decisionAttrs are a decision's attributes.
func decisionAttrs(d routing.Decision) []attribute.KeyValue {
	return []attribute.KeyValue{
		attrWorker.String(d.Target.Worker.ID), attrRank.Int(int(d.Target.Worker.DPRank)),
		attrOverlap.Int(d.Overlap), attrPrompt.Int(d.PromptBlocks), attrBound.Bool(d.Bound),
		attrRevision.Int64(int64(d.Binding.Revision)),
	}
}

// fail marks span as failed with err.
func failSpan(span trace.Span, cause string, err error) {
	span.SetAttributes(attrCause.String(cause))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, cause)
	}
}

// traceHeaders appends the traceparent (and tracestate) of ctx's span to a worker's request
// headers.
func (t *tracing) traceHeaders(ctx context.Context, b []byte) []byte {
	c := propagation.MapCarrier{}
	t.prop.Inject(ctx, c)
	for _, k := range [...]string{"traceparent", "tracestate"} {
		if v := c[k]; v != "" {
			b = appendHeaderLine(b, http.CanonicalHeaderKey(k), v)
		}
	}
	return b
}
