// Package metricstest reads a registry's metrics the way the tests of a
// daemon's metrics check them: by name and a subset of their labels.
package metricstest

import (
	"io"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Families are metric families by name.
type Families = map[string]*dto.MetricFamily

// Gather gathers g by metric name.
func Gather(g prometheus.Gatherer) (Families, error) {
	got, err := g.Gather()
	if err != nil {
		return nil, err
	}
	fams := Families{}
	for _, f := range got {
		fams[f.GetName()] = f
	}
	return fams, nil
}

// Parse reads metrics in the Prometheus text format (a /metrics answer).
func Parse(r io.Reader) (Families, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	return p.TextToMetricFamilies(r)
}

// Value is the value of the first metric of fams named name whose labels
// include want (a histogram's sample count), or -1 where there is none.
func Value(fams Families, name string, want map[string]string) float64 {
	f := fams[name]
	if f == nil {
		return -1
	}
metric:
	for _, m := range f.Metric {
		for k, v := range want {
			found := false
			for _, l := range m.Label {
				found = found || (l.GetName() == k && l.GetValue() == v)
			}
			if !found {
				continue metric
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	return -1
}
