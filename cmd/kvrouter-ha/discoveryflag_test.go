package main

import (
	"slices"
	"testing"
)

func TestDiscoveryFlagKeepsAKubernetesValueWhole(t *testing.T) {
	for _, tc := range []struct {
		values []string
		want   []string
	}{
		{values: []string{"file:/a,dns:w:8000"}, want: []string{"file:/a", "dns:w:8000"}},
		{values: []string{"kubernetes:namespace=ns,selector=app=vllm,tier=gpu,port=8000"}, want: []string{"kubernetes:namespace=ns,selector=app=vllm,tier=gpu,port=8000"}},
		{values: []string{"file:/a, kubernetes:namespace=ns,pool=p", "dns:w:1"}, want: []string{"file:/a", "kubernetes:namespace=ns,pool=p", "dns:w:1"}},
	} {
		var got []string
		f := discoveryFlag{&got}
		for _, v := range tc.values {
			if err := f.Set(v); err != nil {
				t.Fatal(err)
			}
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%q: got %q, want %q", tc.values, got, tc.want)
		}
	}
}
