package indexer

// chunkLen is the number of records per recency chunk: 6 KiB chunks keep the slack of a
// partly used chunk per worker negligible next to a million entries.
const chunkLen = 512

// chunk is a fixed run of records, keys and ticks in separate arrays so a record costs 12 bytes.
type chunk struct {
	keys  [chunkLen]uint64
	ticks [chunkLen]uint32
}

// recency is a worker's FIFO of (key, tick) records, oldest first, in chunks so that it never
// copies its contents to grow and never holds more than one chunk of slack at each end.
type recency struct {
	chunks []*chunk
	head   int // position of the oldest record in chunks[0]
	n      int
	spare  *chunk // the last chunk popped off the front, reused by the next push that needs one
}

// len returns the number of records.
func (q *recency) len() int { return q.n }

// push appends a record at the newest end.
func (q *recency) push(key uint64, tick uint32) {
	pos := q.head + q.n
	c := pos / chunkLen
	if c == len(q.chunks) {
		nc := q.spare
		q.spare = nil
		if nc == nil {
			nc = new(chunk)
		}
		q.chunks = append(q.chunks, nc)
	}
	ch := q.chunks[c]
	ch.keys[pos%chunkLen] = key
	ch.ticks[pos%chunkLen] = tick
	q.n++
}

// at returns record i, 0 being the oldest. i must be below len().
func (q *recency) at(i int) (uint64, uint32) {
	pos := q.head + i
	ch := q.chunks[pos/chunkLen]
	return ch.keys[pos%chunkLen], ch.ticks[pos%chunkLen]
}

// set overwrites record i. i must be below len().
func (q *recency) set(i int, key uint64, tick uint32) {
	pos := q.head + i
	ch := q.chunks[pos/chunkLen]
	ch.keys[pos%chunkLen] = key
	ch.ticks[pos%chunkLen] = tick
}

// pop drops the oldest record. len() must be above 0.
func (q *recency) pop() {
	q.head++
	q.n--
	if q.head == chunkLen {
		q.spare = q.chunks[0]
		q.chunks[0] = nil
		q.chunks = q.chunks[1:]
		q.head = 0
	}
}

// truncate keeps the oldest n records and frees the chunks past them.
func (q *recency) truncate(n int) {
	q.n = n
	need := (q.head + n + chunkLen - 1) / chunkLen
	clear(q.chunks[need:])
	q.chunks = q.chunks[:need]
}

// reset drops every record and frees the chunks.
func (q *recency) reset() {
	*q = recency{}
}
