package openai

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestChildrenCountOnTheVectorsOwnSeries checks that the resolved children are the vector's
// own, one per set of label values: adds through them show in the vector's series, each in
// its own.
func TestChildrenCountOnTheVectorsOwnSeries(t *testing.T) {
	cases := []struct {
		name   string
		labels []string
		adds   [][2]string // label values of each add, in order
		want   map[[2]string]float64
	}{
		{name: "one label", labels: []string{"model"},
			adds: [][2]string{{"m1", ""}, {"m2", ""}, {"m1", ""}},
			want: map[[2]string]float64{{"m1", ""}: 2, {"m2", ""}: 1}},
		{name: "two labels", labels: []string{"worker", "by"},
			adds: [][2]string{{"w0", "choice"}, {"w0", "binding"}, {"w1", "choice"}, {"w0", "choice"}},
			want: map[[2]string]float64{{"w0", "choice"}: 2, {"w0", "binding"}: 1, {"w1", "choice"}: 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			vec := prometheus.NewCounterVec(prometheus.CounterOpts{Name: "test_total", Help: "test"}, tc.labels)
			c := &children{vec: vec, labels: len(tc.labels)}
			for _, a := range tc.adds {
				c.with(a[0], a[1]).Inc()
			}
			if n := testutil.CollectAndCount(vec); n != len(tc.want) {
				t.Fatalf("%d series, want %d", n, len(tc.want))
			}
			for k, want := range tc.want {
				values := k[:len(tc.labels)]
				if got := testutil.ToFloat64(vec.WithLabelValues(values...)); got != want {
					t.Errorf("%v: %v, want %v", values, got, want)
				}
			}
		})
	}
}
