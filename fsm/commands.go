package fsm

import (
	"errors"
	"fmt"
	"strings"
	"time"
)

// Limits every command is checked against, in Encode, Decode and Apply alike.
const (
	// MaxKeyLen bounds a session key, a worker id and a member's fields, in bytes.
	MaxKeyLen = 256
	// MaxSpecLen bounds a worker's opaque spec.
	MaxSpecLen = 64 << 10
	// MaxCheckpointEntries bounds one Checkpoint (a leader sends several).
	MaxCheckpointEntries = 1 << 16
	// MaxCommandLen bounds an encoded command.
	MaxCommandLen = 32 << 20
	// MaxAliasTargets bounds an alias's targets.
	MaxAliasTargets = 16
	// MaxAliasWeight bounds one target's weight.
	MaxAliasWeight = 1000
	// MaxAliases bounds the aliases the state holds.
	MaxAliases = 1024
	// MaxBoundModels bounds the distinct models the bindings record at once.
	MaxBoundModels = 1<<16 - 1
)

// Errors that Decode, Encode and Apply wrap.
var (
	// ErrInvalid: a field breaks a rule or a limit (bad session key, negative TTL...).
	ErrInvalid = errors.New("invalid command")
	// ErrMalformed: the bytes are not a command (empty, truncated, not protobuf).
	ErrMalformed = errors.New("malformed command")
	// ErrUnknownType: the type byte names no command this code knows.
	ErrUnknownType = errors.New("unknown command type")
)

// Command is one operation of the state machine. The set is closed: the implementations
// are the types of this package.
type Command interface {
	// kind is the command's type byte, without the ignore-if-unknown flag.
	kind() byte
	validate() error
	apply(f *FSM, index uint64) *Result
}

// Bind binds Session to Worker. ExpectRevision 0 binds only if the session is unbound
// (otherwise Status Exists with the current binding); any other value is a compare-and-set
// on the current binding's revision (Status Conflict on a mismatch). Both forms are
// idempotent in effect: a retried or duplicated Bind finds the binding its first copy made
// (Exists) or a revision that no longer matches (Conflict), so a retried forward never
// creates two bindings or replaces the binding it created.
type Bind struct {
	Session        string
	Worker         string
	DPRank         uint32
	ExpectRevision uint64
	// TTL is the idle TTL the binder asks for; it is stored, not enforced here.
	TTL time.Duration
	// MaxBindings caps the number of bindings when creating a new session (0: no cap).
	MaxBindings uint64
	// Model is the model the session's requests are sent as ("" for none): an alias's
	// chosen target, kept with the binding so the session keeps it.
	Model string
}

// Invalidate removes Session's binding if its revision is Revision.
type Invalidate struct {
	Session  string
	Revision uint64
}

// Expire is Invalidate proposed by the leader's idle timer; the change is reported with
// Reason Expired.
type Expire struct {
	Session  string
	Revision uint64
}

// InvalidateWorker removes every binding of Worker (every dp rank).
type InvalidateWorker struct {
	Worker string
}

// Remaining is one binding's remaining idle TTL in a Checkpoint.
type Remaining struct {
	Session   string
	Revision  uint64
	Remaining time.Duration
}

// Checkpoint records remaining idle TTLs, each applied only if the binding's revision
// still matches, so a new leader can re-arm timers from them instead of from full TTLs.
// Aged first takes that much off the remaining TTL of every binding checkpointed before
// (never below a millisecond): the leader sends the time since its previous checkpoint,
// so a binding idle since its last entry needs no new one (zero in older logs: no ageing).
type Checkpoint struct {
	Entries []Remaining
	Aged    time.Duration
}

// AddWorker adds or replaces a registry worker and clears its Draining mark.
type AddWorker struct {
	ID   string
	Spec []byte
}

// DrainWorker marks a registry worker draining and removes its bindings.
type DrainWorker struct {
	ID string
}

// RemoveWorker deletes a registry worker and removes its bindings.
type RemoveWorker struct {
	ID string
}

// SetMember adds or replaces a cluster member.
type SetMember struct {
	Member Member
}

// RemoveMember deletes a cluster member.
type RemoveMember struct {
	ID string
}

// SetAlias adds or replaces a model alias. Its targets must not be aliases, and its name
// must not be another alias's target (no alias of an alias).
type SetAlias struct {
	Alias Alias
}

// DeleteAlias removes a model alias.
type DeleteAlias struct {
	Name string
}

// Type bytes on the log. Values are never reused; flagIgnorable marks a command an older
// replica may skip rather than stop on.
const (
	typeBind             byte = 1
	typeInvalidate       byte = 2
	typeExpire           byte = 3
	typeInvalidateWorker byte = 4
	typeCheckpoint       byte = 5
	typeAddWorker        byte = 6
	typeDrainWorker      byte = 7
	typeRemoveWorker     byte = 8
	typeSetMember        byte = 9
	typeRemoveMember     byte = 10
	// Alias commands are proposed with flagIgnorable: a replica of an older release skips
	// them (it then knows no alias, so a request for one is answered 404 model_not_found
	// there) instead of stopping.
	typeSetAlias    byte = 11
	typeDeleteAlias byte = 12

	flagIgnorable byte = 0x80
)

func (*Bind) kind() byte             { return typeBind }
func (*Invalidate) kind() byte       { return typeInvalidate }
func (*Expire) kind() byte           { return typeExpire }
func (*InvalidateWorker) kind() byte { return typeInvalidateWorker }
func (*Checkpoint) kind() byte       { return typeCheckpoint }
func (*AddWorker) kind() byte        { return typeAddWorker }
func (*DrainWorker) kind() byte      { return typeDrainWorker }
func (*RemoveWorker) kind() byte     { return typeRemoveWorker }
func (*SetMember) kind() byte        { return typeSetMember }
func (*RemoveMember) kind() byte     { return typeRemoveMember }
func (*SetAlias) kind() byte         { return typeSetAlias }
func (*DeleteAlias) kind() byte      { return typeDeleteAlias }

// ignorable reports whether a replica that does not know type t may skip it.
func ignorable(t byte) bool { return t == typeSetAlias || t == typeDeleteAlias }

// ValidSession reports whether s is an acceptable session key: 1 to MaxKeyLen bytes of
// printable ASCII (0x20-0x7e).
func ValidSession(s string) error {
	return validKey("session key", s)
}

// ValidWorker reports whether id is an acceptable worker id (the rule of ValidSession).
func ValidWorker(id string) error {
	return validKey("worker id", id)
}

func validKey(what, s string) error {
	if s == "" {
		return fmt.Errorf("%w: %s is empty", ErrInvalid, what)
	}
	if len(s) > MaxKeyLen {
		return fmt.Errorf("%w: %s %.32q... is %d bytes, over %d", ErrInvalid, what, s, len(s), MaxKeyLen)
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; c < 0x20 || c > 0x7e {
			return fmt.Errorf("%w: %s %.32q has a non-printable byte 0x%02x at %d", ErrInvalid, what, s, c, i)
		}
	}
	return nil
}

// validAddr checks a member address: printable ASCII, at most MaxKeyLen, may be empty.
func validAddr(what, s string) error {
	if s == "" {
		return nil
	}
	return validKey(what, s)
}

func validRevision(r uint64) error {
	if r == 0 {
		return fmt.Errorf("%w: revision 0 names no binding", ErrInvalid)
	}
	return nil
}

func (c *Bind) validate() error {
	if err := ValidSession(c.Session); err != nil {
		return err
	}
	if err := ValidWorker(c.Worker); err != nil {
		return err
	}
	if c.TTL < 0 {
		return fmt.Errorf("%w: negative ttl %v", ErrInvalid, c.TTL)
	}
	if c.Model != "" {
		return ValidModel(c.Model)
	}
	return nil
}

func (c *Invalidate) validate() error {
	if err := ValidSession(c.Session); err != nil {
		return err
	}
	return validRevision(c.Revision)
}

func (c *Expire) validate() error {
	if err := ValidSession(c.Session); err != nil {
		return err
	}
	return validRevision(c.Revision)
}

func (c *InvalidateWorker) validate() error { return ValidWorker(c.Worker) }

func (c *Checkpoint) validate() error {
	if len(c.Entries) > MaxCheckpointEntries {
		return fmt.Errorf("%w: checkpoint of %d entries, over %d", ErrInvalid, len(c.Entries), MaxCheckpointEntries)
	}
	if c.Aged < 0 {
		return fmt.Errorf("%w: checkpoint aged by %v, must not be negative", ErrInvalid, c.Aged)
	}
	for i, e := range c.Entries {
		if err := ValidSession(e.Session); err != nil {
			return fmt.Errorf("checkpoint entry %d: %w", i, err)
		}
		if err := validRevision(e.Revision); err != nil {
			return fmt.Errorf("checkpoint entry %d: %w", i, err)
		}
		if e.Remaining <= 0 {
			return fmt.Errorf("%w: checkpoint entry %d: remaining ttl %v must be positive", ErrInvalid, i, e.Remaining)
		}
	}
	return nil
}

func (c *AddWorker) validate() error {
	if err := ValidWorker(c.ID); err != nil {
		return err
	}
	if len(c.Spec) > MaxSpecLen {
		return fmt.Errorf("%w: worker %s: spec of %d bytes, over %d", ErrInvalid, c.ID, len(c.Spec), MaxSpecLen)
	}
	return nil
}

func (c *DrainWorker) validate() error  { return ValidWorker(c.ID) }
func (c *RemoveWorker) validate() error { return ValidWorker(c.ID) }

func (c *SetMember) validate() error {
	if err := validKey("member id", c.Member.ID); err != nil {
		return err
	}
	if err := validAddr("member raft address", c.Member.RaftAddr); err != nil {
		return err
	}
	return validAddr("member peer address", c.Member.PeerAddr)
}

func (c *RemoveMember) validate() error { return validKey("member id", c.ID) }

// ValidModel reports whether name is an acceptable model or alias name: 1 to MaxKeyLen
// bytes of printable ASCII without spaces (routing.ValidateModelName's rule).
func ValidModel(name string) error {
	if err := validKey("model name", name); err != nil {
		return err
	}
	if i := strings.IndexByte(name, ' '); i >= 0 {
		return fmt.Errorf("%w: model name %.32q has a space at %d", ErrInvalid, name, i)
	}
	return nil
}

// ValidAlias checks an alias on its own: a valid name, 1 to MaxAliasTargets distinct
// valid targets other than the alias itself, weights 0..MaxAliasWeight with at least one
// positive. (Whether a target is itself an alias depends on the state: SetAlias's apply.)
func ValidAlias(a Alias) error {
	if err := ValidModel(a.Name); err != nil {
		return fmt.Errorf("alias: %w", err)
	}
	if len(a.Targets) == 0 {
		return fmt.Errorf("%w: alias %q has no targets", ErrInvalid, a.Name)
	}
	if len(a.Targets) > MaxAliasTargets {
		return fmt.Errorf("%w: alias %q has %d targets, over %d", ErrInvalid, a.Name, len(a.Targets), MaxAliasTargets)
	}
	positive := false
	for i, t := range a.Targets {
		if err := ValidModel(t.Model); err != nil {
			return fmt.Errorf("alias %q target %d: %w", a.Name, i, err)
		}
		if t.Model == a.Name {
			return fmt.Errorf("%w: alias %q names itself as a target", ErrInvalid, a.Name)
		}
		for _, o := range a.Targets[:i] {
			if o.Model == t.Model {
				return fmt.Errorf("%w: alias %q lists target %q twice", ErrInvalid, a.Name, t.Model)
			}
		}
		if t.Weight > MaxAliasWeight {
			return fmt.Errorf("%w: alias %q target %q: weight %d over %d", ErrInvalid, a.Name, t.Model, t.Weight, MaxAliasWeight)
		}
		positive = positive || t.Weight > 0
	}
	if !positive {
		return fmt.Errorf("%w: alias %q: every weight is 0, at least one must be positive", ErrInvalid, a.Name)
	}
	return nil
}

func (c *SetAlias) validate() error { return ValidAlias(c.Alias) }

func (c *DeleteAlias) validate() error {
	if err := ValidModel(c.Name); err != nil {
		return fmt.Errorf("alias: %w", err)
	}
	return nil
}
