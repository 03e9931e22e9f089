package extproc

import "github.com/prometheus/client_golang/prometheus"

// metrics are the picker's own; the decisions it holds count in the front's metrics too.
type metrics struct {
	requests        *prometheus.CounterVec
	pick            prometheus.Histogram
	open            prometheus.Gauge
	ended           *prometheus.CounterVec
	servedElsewhere prometheus.Counter
}

func newMetrics() *metrics {
	return &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_extproc_requests_total",
			Help: "Gateway requests by outcome: picked, disaggregated, or the status of the picker's immediate answer."}, []string{"outcome"}),
		pick: prometheus.NewHistogram(prometheus.HistogramOpts{Name: "kvrouter_extproc_pick_seconds",
			Help:    "From a request's complete body to the picker's answer naming its endpoint.",
			Buckets: prometheus.ExponentialBuckets(10e-6, 2, 18)}),
		open: prometheus.NewGauge(prometheus.GaugeOpts{Name: "kvrouter_extproc_streams",
			Help: "Gateway streams open."}),
		ended: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "kvrouter_extproc_streams_cut_total",
			Help: "Gateway streams the picker ended itself: idle (owing a message past --ext-proc-idle-timeout) or overloaded (past --ext-proc-max-streams)."}, []string{"reason"}),
		servedElsewhere: prometheus.NewCounter(prometheus.CounterOpts{Name: "kvrouter_extproc_served_elsewhere_total",
			Help: "Requests the gateway says another endpoint than the picked one served."}),
	}
}

func (m *metrics) register(r prometheus.Registerer) error {
	for _, c := range []prometheus.Collector{m.requests, m.pick, m.open, m.ended, m.servedElsewhere} {
		if err := r.Register(c); err != nil {
			return err
		}
	}
	return nil
}
