package jepsen

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"time"

	"github.com/kvrouter-ha/kvrouter-ha/internal/proc"
)

// spareWorkers is how many workers the discovery fault can start, one at a time.
const spareWorkers = 2

// Discovery timing given to the replicas with the discovery fault: a look every 250 ms, a gone
// worker drained for 2 s before it is removed. The only worker of the file going is a drop of
// every worker the source lists, which discovery holds as suspect: for 500 ms here.
const (
	discoveryInterval   = 250 * time.Millisecond
	discoveryDrainFor   = 2 * time.Second
	discoverySuspectFor = 500 * time.Millisecond
)

// openDiscovery makes the spare workers and the empty discovery file, and returns the serve
// flags that point the replicas at it.
func (f *fleet) openDiscovery(dir, logs string) ([]string, error) {
	for j := range spareWorkers {
		addr, err := f.net.addr(f.net.workerHost(), portWorker+f.cfg.Workers+j)
		if err != nil {
			return nil, err
		}
		w := &workerNode{id: fmt.Sprintf("d%d", j), addr: addr}
		w.proc = proc.New(proc.Spec{
			Name:    w.id,
			Argv:    []string{f.cfg.Binary, "sim-worker", "--listen", addr, "--id", w.id, "--log-level", "warn"},
			Wrap:    f.net.wrap("workers"),
			LogPath: filepath.Join(logs, w.id+".log"),
		})
		f.spares = append(f.spares, w)
	}
	f.fleetFile = filepath.Join(dir, "discovered-workers.json")
	if err := f.listSpares(nil); err != nil {
		return nil, err
	}
	return []string{"--discovery", "file:" + f.fleetFile, "--discovery-interval", discoveryInterval.String(),
		"--discovery-drain-for", discoveryDrainFor.String(), "--discovery-suspect-for", discoverySuspectFor.String()}, nil
}

// listSpares writes the discovery file: the spares ws, nothing else.
func (f *fleet) listSpares(ws []*workerNode) error {
	type spec struct {
		ID  string `json:"id"`
		URL string `json:"url"`
	}
	specs := []spec{}
	for _, w := range ws {
		specs = append(specs, spec{ID: w.id, URL: "http://" + w.addr})
	}
	return proc.WriteFleetFile(f.fleetFile, specs)
}

// waitListed waits until every replica lists worker id (want) or none does (!want).
func (f *fleet) waitListed(ctx context.Context, id string, want bool, within time.Duration) error {
	return f.poll(ctx, within, func(ctx context.Context) error {
		for _, r := range f.replicas {
			ws, err := f.workerStates(ctx, r)
			if err != nil {
				return err
			}
			listed := slices.ContainsFunc(ws, func(w workerStatus) bool { return w.Spec.ID == id })
			if listed != want {
				return fmt.Errorf("%s lists %s: %v", r.ID, id, listed)
			}
		}
		return nil
	})
}

// discoveryStep starts a spare worker and lists it in the discovery file, waits until every
// replica has it and then the step's hold (new sessions bind to it), then takes it out of the
// file, waits until no replica has it (discovery drains it, its sessions move, then removes
// it) and stops it. Taking it out happens even when the run is cancelled.
func (n *nemesis) discoveryStep(ctx context.Context, s Step) {
	f := n.f
	w := f.spares[s.Index%len(f.spares)]
	heal := context.WithoutCancel(ctx)
	add := n.rec.beginFault(FaultDiscovery, []string{w.id}, "worker "+w.id+" started and listed in the discovery file")
	err := w.proc.Start()
	if err == nil {
		err = proc.WaitReady(ctx, f.admin, "http://"+w.addr+"/health", 30*time.Second)
	}
	if err == nil {
		err = f.listSpares([]*workerNode{w})
	}
	if err == nil {
		err = f.waitListed(ctx, w.id, true, 30*time.Second)
	}
	n.rec.endFault(add)
	if err != nil {
		n.rec.faultError(add, err)
	} else {
		n.rec.recoverFault(add)
		_ = sleep(ctx, s.Hold)
	}

	drain := n.rec.beginFault(FaultDrain, []string{w.id}, "worker "+w.id+" taken out of the discovery file: drained, then removed")
	if err := f.listSpares(nil); err != nil {
		n.rec.faultError(drain, err)
	}
	if err := f.waitListed(heal, w.id, false, 60*time.Second); err != nil {
		n.rec.faultError(drain, err)
	}
	w.proc.Kill()
	n.rec.endFault(drain)
	n.recover(ctx, drain)
}
