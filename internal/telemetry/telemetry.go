// Package telemetry sets up OpenTelemetry tracing from the standard OTEL_* environment
// variables: off unless OTEL_TRACES_EXPORTER is "otlp" or an OTLP endpoint
// (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set, and never with
// OTEL_SDK_DISABLED=true or OTEL_TRACES_EXPORTER=none. The exporter is OTLP over gRPC, which
// reads its endpoint, headers, TLS and timeout from the same variables; the sampler comes from
// OTEL_TRACES_SAMPLER (parent-based, always on by default); the resource from
// OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, with service.name kvrouter-ha and the
// replica's id as service.instance.id unless they say otherwise.
package telemetry

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"

	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracegrpc"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.37.0"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"
)

// Tracing is the process's tracer provider and how to flush and stop it.
type Tracing struct {
	// Provider makes the tracers: the SDK's when tracing is on, a no-op one when off.
	Provider trace.TracerProvider
	sdk      *sdktrace.TracerProvider
}

// Enabled reports whether spans are exported.
func (t *Tracing) Enabled() bool { return t.sdk != nil }

// Shutdown flushes the spans not yet exported and stops the exporter (nothing when off).
func (t *Tracing) Shutdown(ctx context.Context) error {
	if t.sdk == nil {
		return nil
	}
	if err := t.sdk.Shutdown(ctx); err != nil {
		return fmt.Errorf("telemetry: shutdown: %w", err)
	}
	return nil
}

// enabled reads the variables that turn tracing on or off.
func enabled(getenv func(string) string) bool {
	if strings.EqualFold(getenv("OTEL_SDK_DISABLED"), "true") {
		return false
	}
	switch exp := strings.ToLower(strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER"))); exp {
	case "otlp":
		return true
	case "none":
		return false
	}
	return getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// FromEnv sets tracing up as the environment says, for the replica named instance.
func FromEnv(ctx context.Context, instance string) (*Tracing, error) {
	if !enabled(os.Getenv) {
		return &Tracing{Provider: noop.NewTracerProvider()}, nil
	}
	if exp := strings.ToLower(os.Getenv("OTEL_TRACES_EXPORTER")); exp != "" && exp != "otlp" && exp != "none" {
		return nil, fmt.Errorf("telemetry: OTEL_TRACES_EXPORTER %q: only otlp (over gRPC) and none are supported", exp)
	}
	exporter, err := otlptracegrpc.New(ctx)
	if err != nil {
		return nil, fmt.Errorf("telemetry: OTLP exporter: %w", err)
	}
	res, err := resource.Merge(
		resource.NewSchemaless(semconv.ServiceName("kvrouter-ha"), semconv.ServiceInstanceID(instance)),
		// The environment's service name and attributes win over the defaults above.
		resource.Environment(),
	)
	if err != nil && !errors.Is(err, resource.ErrPartialResource) {
		return nil, fmt.Errorf("telemetry: resource: %w", err)
	}
	sdk := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exporter), sdktrace.WithResource(res))
	return &Tracing{Provider: sdk, sdk: sdk}, nil
}
