-- kvrouter.lua: HAProxy carries the bytes, kvrouter-ha decides where they go.
--
-- For HAProxy 2.6 or later, built with Lua (haproxy -vv says "Built with Lua"). haproxy.cfg,
-- next to this file, is the configuration it is written for; deploy/README.md ("HAProxy carries
-- the bytes") says what it does and where its limits are. In short:
--
--   action lua.kvrouter_reserve   (http-request, after the body is buffered) asks a replica's
--                                 decision service, POST /v1/reserve with the request's body
--                                 and headers, where the request goes,
--                                 trying the servers of backend kvr_replicas in their order
--                                 (those whose health check fails last), and sets the
--                                 variables haproxy.cfg sends the request on with:
--                                 txn.kvr_addr, txn.kvr_port (the worker), txn.kvr_worker,
--                                 txn.kvr_replica, txn.kvr_revision, txn.kvr_overlap (response
--                                 headers) and txn.kvr_fallback (no decision: round-robin).
--   filter lua.kvrouter_release   (in the backend that sends to the chosen worker) releases
--                                 the reservation on the replica that made it once the
--                                 response is over: DELETE /v1/reservations/{id}, with
--                                 ?completed=true when the worker's 2xx answer came whole, and
--                                 &output_tokens=N when the answer carried a usage block.
--
-- Settings, from the environment (haproxy.cfg gives their defaults with presetenv):
--   KVR_FAIL              "open" (default): with no decision (every replica failing), the
--                         request goes round-robin to backend kvr_workers; "closed": it is
--                         answered 503 with an OpenAI-shaped error.
--   KVR_DECISION_TIMEOUT  seconds one replica may take to connect and answer (default 5;
--                         above the replicas' --bind-wait, 3s, which a new session may wait
--                         out during an election).
--
-- HAProxy's Lua has no JSON library: the few fields needed are read by a small reader of the
-- answer's top-level object below; an answer it cannot read counts as a failed replica.
-- core.tcp is used rather than core.httpclient: in 2.6.12 the latter took three seconds to
-- give up on a refused connection (it retries, a second apart, whatever its timeout says), so
-- a dead replica would have cost every request three seconds.

local REPLICAS = "kvr_replicas" -- the backend whose servers are the decision service
local MAX_ANSWER = 65536        -- bytes of a decision answer read at most

-- A setting that cannot be read stops HAProxy at start rather than surprise later.
local fail_mode = os.getenv("KVR_FAIL") or "open"
if fail_mode ~= "open" and fail_mode ~= "closed" then
	error("kvrouter.lua: KVR_FAIL must be open or closed, not " .. fail_mode)
end
local fail_closed = fail_mode == "closed"
local timeout = tonumber(os.getenv("KVR_DECISION_TIMEOUT") or "5")
if not timeout or timeout <= 0 then
	error("kvrouter.lua: KVR_DECISION_TIMEOUT must be a positive number of seconds, not " .. os.getenv("KVR_DECISION_TIMEOUT"))
end

-- ---- a small reader of a JSON object's top-level fields

-- JSON escapes and what they stand for.
local escapes = {['"'] = '"', ['\\'] = '\\', ['/'] = '/', b = '\b', f = '\f', n = '\n', r = '\r', t = '\t'}

-- read_string reads the JSON string that opens at s[i] ('"'): its value and the index after
-- it, or nil when it is not a well-formed string.
local function read_string(s, i)
	local out, j = {}, i + 1
	while true do
		local k = s:find('["\\]', j)
		if not k then
			return nil
		end
		out[#out + 1] = s:sub(j, k - 1)
		if s:sub(k, k) == '"' then
			return table.concat(out), k + 1
		end
		local e = s:sub(k + 1, k + 1)
		if escapes[e] then
			out[#out + 1] = escapes[e]
			j = k + 2
		elseif e == 'u' then
			local hex = s:match('^%x%x%x%x', k + 2)
			if not hex then
				return nil
			end
			local cp = tonumber(hex, 16)
			j = k + 6
			local lo = s:match('^\\u([dD][c-fC-F]%x%x)', j)
			if cp >= 0xD800 and cp <= 0xDBFF and lo then
				cp = 0x10000 + (cp - 0xD800) * 0x400 + (tonumber(lo, 16) - 0xDC00)
				j = j + 6
			elseif cp >= 0xD800 and cp <= 0xDFFF then
				cp = 0xFFFD -- a lone surrogate
			end
			out[#out + 1] = utf8.char(cp)
		else
			return nil
		end
	end
end

-- skip_nested returns the index after the object or array that opens at s[i].
local function skip_nested(s, i)
	local depth = 0
	while true do
		local k = s:find('[%[%]{}"]', i)
		if not k then
			return nil
		end
		local c = s:sub(k, k)
		if c == '"' then
			local _, after = read_string(s, k)
			if not after then
				return nil
			end
			i = after
		else
			depth = depth + ((c == '{' or c == '[') and 1 or -1)
			if depth == 0 then
				return k + 1
			end
			i = k + 1
		end
	end
end

-- top_fields reads s as one JSON object and returns its top-level strings, numbers and
-- booleans by key (nested objects and arrays are skipped, null is left out), or nil when s
-- is not a JSON object.
local function top_fields(s)
	local function ws(i)
		return s:find('[^ \t\r\n]', i) or #s + 1
	end
	local i = ws(1)
	if s:sub(i, i) ~= '{' then
		return nil
	end
	local fields = {}
	i = ws(i + 1)
	if s:sub(i, i) == '}' then
		return fields
	end
	while true do
		if s:sub(i, i) ~= '"' then
			return nil
		end
		local key, after = read_string(s, i)
		if not key then
			return nil
		end
		i = ws(after)
		if s:sub(i, i) ~= ':' then
			return nil
		end
		i = ws(i + 1)
		local c = s:sub(i, i)
		if c == '"' then
			fields[key], i = read_string(s, i)
			if not i then
				return nil
			end
		elseif c == '{' or c == '[' then
			i = skip_nested(s, i)
			if not i then
				return nil
			end
		else
			local lit = s:match('^[%w%.%+%-]+', i)
			if not lit then
				return nil
			end
			if lit == 'true' or lit == 'false' then
				fields[key] = lit == 'true'
			elseif lit ~= 'null' then
				fields[key] = tonumber(lit)
				if not fields[key] then
					return nil
				end
			end
			i = i + #lit
		end
		i = ws(i)
		c = s:sub(i, i)
		if c == '}' then
			return fields
		elseif c ~= ',' then
			return nil
		end
		i = ws(i + 1)
	end
end

-- ---- HTTP/1.1 over core.tcp

-- split_addr splits "ip:port" (an IPv6 address may be bare or bracketed).
local function split_addr(a)
	local host, port = a:match('^%[?(.-)%]?:(%d+)$')
	return host, tonumber(port)
end

-- call sends one request with Connection: close and returns the status, the headers (names
-- in lower case) and the body, or nil and what went wrong.
local function call(addr, method, path, headers, body)
	local host, port = split_addr(addr)
	if not host then
		return nil, "not an ip:port: " .. addr
	end
	local s = core.tcp()
	s:settimeout(timeout)
	local ok, err = s:connect(host, port)
	if not ok then
		s:close()
		return nil, "connect: " .. tostring(err)
	end
	local req = {method, " ", path, " HTTP/1.1\r\nHost: ", addr, "\r\nConnection: close\r\n"}
	for _, h in ipairs(headers) do
		req[#req + 1] = h[1] .. ": " .. h[2] .. "\r\n"
	end
	req[#req + 1] = "Content-Length: " .. #(body or "") .. "\r\n\r\n"
	req[#req + 1] = body or ""
	if not s:send(table.concat(req)) then
		s:close()
		return nil, "send failed"
	end
	local line = s:receive("*l")
	local status = line and tonumber(line:match("^HTTP/1%.%d (%d%d%d)"))
	if not status then
		s:close()
		return nil, "no HTTP answer: " .. tostring(line)
	end
	local hdrs = {}
	while true do
		line = s:receive("*l")
		if not line then
			s:close()
			return nil, "answer cut in its headers"
		end
		line = line:gsub("\r$", "")
		if line == "" then
			break
		end
		local k, v = line:match("^([^:]+):%s*(.-)%s*$")
		if k then
			hdrs[k:lower()] = v
		end
	end
	local n = tonumber(hdrs["content-length"] or "")
	local data
	if status == 204 or status == 304 or n == 0 then
		data = ""
	elseif hdrs["transfer-encoding"] then
		data = nil -- the decision service never chunks its small answers
	elseif n and n <= MAX_ANSWER then
		data = s:receive(n)
	elseif not n then
		data = s:receive("*a") or "" -- up to the close
	end
	s:close()
	if not data or #data > MAX_ANSWER or (n and #data ~= n) then
		return nil, "unreadable answer body"
	end
	return status, hdrs, data
end

-- ---- the replicas

-- failed remembers, by server name, when a call to that replica last got no answer: for a
-- second or two it is tried after the others, until its health check has caught up (a
-- stopped replica would otherwise hold every request for the whole timeout).
local failed = {}

-- replicas lists the decision service's addresses in the order to try them: the servers of
-- backend kvr_replicas in their configuration order, those up (or unchecked) first, then
-- those down or just failed here; servers in maintenance are skipped.
local function replicas()
	local be = core.backends[REPLICAS]
	if not be then
		return {}
	end
	local good, bad = {}, {}
	local now = core.now().sec
	for name, srv in pairs(be.servers) do
		local st = srv:get_stats()
		local status = tostring(st.status)
		if not status:find("^MAINT") then
			local r = {name = name, addr = srv:get_addr(), sid = tonumber(st.sid) or 0}
			local up = status == "no check" or status:find("^UP") ~= nil
			if up and not (failed[name] and now - failed[name] <= 1) then
				good[#good + 1] = r
			else
				bad[#bad + 1] = r
			end
		end
	end
	local by_sid = function(a, b) return a.sid < b.sid end
	table.sort(good, by_sid)
	table.sort(bad, by_sid)
	for _, r in ipairs(bad) do
		good[#good + 1] = r
	end
	return good
end

-- ---- answers of our own

local function json_string(s)
	return '"' .. s:gsub('[%c"\\]', function(c)
		return escapes[c] and '\\' .. c or string.format('\\u%04x', c:byte())
	end) .. '"'
end

-- answer is a reply for the client: status, headers (name -> value) and body.
local function answer(status, headers, body)
	local h = {}
	for k, v in pairs(headers) do
		h[k] = {v}
	end
	return {status = status, headers = h, body = body}
end

-- api_error is an answer in the OpenAI error shape.
local function api_error(status, typ, code, message)
	return answer(status, {["content-type"] = "application/json"},
		'{"error":{"message":' .. json_string(message) .. ',"type":"' .. typ .. '","code":"' .. code .. '"}}\n')
end

-- release ends reservation id on the replica at addr, in a task of its own (a filter's
-- callbacks may not wait on a socket).
local function release(addr, id, completed, output_tokens)
	local path = "/v1/reservations/" .. id
	if completed then
		path = path .. "?completed=true"
		if output_tokens then
			path = path .. "&output_tokens=" .. output_tokens
		end
	end
	core.register_task(function()
		local status, err = call(addr, "DELETE", path, {}, nil)
		if status ~= 204 then
			core.Warning("kvrouter.lua: release of reservation " .. id .. " on " .. addr .. ": " ..
				tostring(status or err) .. " (it ends with its TTL)")
		end
	end)
end

-- worker_addr returns the IP address, port and path prefix of a worker's base URL, or nil
-- unless it is plain http to an IP address: set-dst takes nothing else, and an address it
-- refused would leave the request to go where the client connected, to HAProxy itself.
local function worker_addr(url)
	if type(url) ~= "string" then
		return nil
	end
	local host, port, prefix = url:match("^http://%[([%x:%.]+)%]:?(%d*)(.*)$")
	if host then
		if not host:find(":") then
			return nil
		end
	else
		host, port, prefix = url:match("^http://([%d%.]+):?(%d*)(.*)$")
		local a, b, c, e = (host or ""):match("^(%d+)%.(%d+)%.(%d+)%.(%d+)$")
		if not a or tonumber(a) > 255 or tonumber(b) > 255 or tonumber(c) > 255 or tonumber(e) > 255 then
			return nil
		end
	end
	port = port == "" and 80 or tonumber(port)
	if not port or port < 1 or port > 65535 or not prefix:find("^/?[^?#]*$") then
		return nil
	end
	return host, port, (prefix:gsub("/$", ""))
end

-- Client headers that do not go on to the decision service: framing and hop-by-hop ones (the
-- call sets its own). Every other header goes, as the replicas' proxy would see it: the
-- session key (X-Session-ID, or whatever the replicas' --session-headers names), the
-- explicit target (X-Target-Worker), the rank (X-Data-Parallel-Rank).
local not_forwarded = {
	["host"] = true, ["content-length"] = true, ["transfer-encoding"] = true, ["connection"] = true,
	["keep-alive"] = true, ["te"] = true, ["trailer"] = true, ["upgrade"] = true, ["expect"] = true,
	["proxy-connection"] = true, ["proxy-authorization"] = true,
}

-- reserve decides where the request goes (the txn.kvr_* variables), or returns the answer the
-- client gets instead.
local function reserve(txn)
	local body = txn.f:req_body() or ""
	local size = txn.f:req_body_size() or 0
	if #body < size then
		return api_error(413, "invalid_request_error", "body_too_large", string.format(
			"the request body (%d bytes) is larger than HAProxy buffers for the routing decision " ..
			"(%d bytes reached it; tune.bufsize in haproxy.cfg), or did not arrive in time", size, #body))
	end
	local headers = {}
	local client = txn.http:req_get_headers()
	for name, vals in pairs(client) do
		if not not_forwarded[name] then
			for i = 0, #vals do
				if vals[i] then
					headers[#headers + 1] = {name, vals[i]}
				end
			end
		end
	end
	if not client["content-type"] then
		headers[#headers + 1] = {"content-type", "application/json"}
	end
	local tried = {}
	for _, r in ipairs(replicas()) do
		local status, hdrs, data = call(r.addr, "POST", "/v1/reserve?path=" .. txn.sf:path(), headers, body)
		local d = status == 200 and top_fields(data)
		if d then
			local id = d.reservation
			local ip, port, prefix = worker_addr(d.url)
			if type(id) ~= "string" or not id:find("^[%w%-_]+$") or type(d.worker) ~= "string" then
				-- Not a decision answer: tried as a failure (a reservation it made, if any,
				-- ends with its TTL).
				tried[#tried + 1] = r.name .. " (" .. r.addr .. "): an answer without worker or reservation"
			elseif not ip then
				release(r.addr, id, false)
				return api_error(502, "server_error", "worker_url_unusable",
					"worker " .. d.worker .. " has URL " .. tostring(d.url) ..
					"; HAProxy sends to a decision's worker by IP address over plain http (set-dst)")
			else
				if prefix ~= "" then
					-- The worker's URL has a path: the request's path follows it, as the
					-- router's proxy sends it.
					txn.http:req_set_path(prefix .. txn.sf:path())
				end
				txn:set_var("txn.kvr_addr", ip)
				txn:set_var("txn.kvr_port", port)
				txn:set_var("txn.kvr_res", id)
				txn:set_var("txn.kvr_res_at", r.addr)
				txn:set_var("txn.kvr_worker", d.worker)
				txn:set_var("txn.kvr_replica", type(d.replica) == "string" and d.replica or r.name)
				txn:set_var("txn.kvr_overlap", tostring(math.tointeger(d.overlap_blocks) or 0))
				if d.session and math.tointeger(d.binding_revision) then
					txn:set_var("txn.kvr_revision", tostring(math.tointeger(d.binding_revision)))
				end
				-- The rank goes to the worker as the router's proxy sends it: only to a
				-- worker that runs data-parallel ranks.
				if (math.tointeger(d.dp_size) or 1) > 1 then
					txn.http:req_set_header("X-Data-Parallel-Rank", tostring(math.tointeger(d.dp_rank) or 0))
				else
					txn.http:req_del_header("X-Data-Parallel-Rank")
				end
				return
			end
		elseif status and status >= 400 and status < 500 then
			-- The router's own answer to this request (400 bad request, 429 too many
			-- reservations, ...): the client gets it as it is.
			local out = {["content-type"] = hdrs["content-type"] or "application/json"}
			out["retry-after"] = hdrs["retry-after"]
			return answer(status, out, data)
		else
			local why = status == 200 and "an answer that is not a JSON object" or status and ("status " .. status) or tostring(hdrs)
			tried[#tried + 1] = r.name .. " (" .. r.addr .. "): " .. why
			if not status then
				-- No answer at all (refused, timed out, cut): not worth waiting on again
				-- before its health check says.
				failed[r.name] = core.now().sec
			end
		end
	end
	-- No decision.
	local why = #tried > 0 and table.concat(tried, "; ") or "backend " .. REPLICAS .. " has no usable server"
	core.Warning("kvrouter.lua: no routing decision (" .. why .. ")" .. (fail_closed and "" or "; round-robin"))
	if fail_closed then
		return api_error(503, "service_unavailable_error", "decision_service_unavailable",
			"no kvrouter-ha replica answered the routing decision: " .. why)
	end
	txn:set_var("txn.kvr_fallback", "round-robin")
end

core.register_action("kvrouter_reserve", {"http-req"}, function(txn)
	-- An error in the Lua itself must not leave the request to go nowhere in particular.
	-- (txn:done is called out here: inside pcall its way of ending the action is caught.)
	local ok, ans = pcall(reserve, txn)
	if not ok then
		core.Alert("kvrouter.lua: " .. tostring(ans))
		ans = nil
		if fail_closed then
			ans = api_error(503, "service_unavailable_error", "decision_service_unavailable", "routing decision failed")
		else
			txn:set_var("txn.kvr_fallback", "round-robin")
		end
	end
	if ans then
		txn:done(txn:reply(ans))
	end
end)

-- ---- the release, at the end of the response

local Release = {}
Release.id = "kvrouter release"
Release.flags = filter.FLT_CFG_FL_HTX
Release.__index = Release

function Release:new()
	return setmetatable({}, Release)
end

-- http_headers notes the worker's status; a 2xx answer's body is watched (http_payload) for
-- its usage and for its end (http_end, which only a watched body gets).
function Release:http_headers(txn, msg)
	if msg.channel:is_resp() then
		self.status = tonumber(txn.sf:status())
		if self.status and self.status >= 200 and self.status < 300 then
			self.tail = ""
			filter.register_data_filter(self, msg.channel)
		end
	end
end

-- http_payload keeps the last "completion_tokens" count seen (the usage of a whole answer, or
-- of a stream's last chunk when the client asked for it), and the end of each piece, so that
-- a count split between two pieces is still read.
function Release:http_payload(txn, msg)
	local data = self.tail .. (msg:body(0, msg:input()) or "")
	for n in data:gmatch('"completion_tokens"%s*:%s*(%d+)') do
		self.output_tokens = n
	end
	self.tail = data:sub(-40)
end

-- release_once releases the transaction's reservation, if it has one and once.
function Release:release_once(txn, completed)
	local id, at = txn:get_var("txn.kvr_res"), txn:get_var("txn.kvr_res_at")
	if id and at and not self.released then
		self.released = true
		release(at, id, completed, completed and self.output_tokens or nil)
	end
end

-- http_end runs when the worker's whole 2xx answer has been through HAProxy: the earliest
-- moment the request is known to be over and complete.
function Release:http_end(txn, msg)
	if msg.channel:is_resp() then
		self:release_once(txn, true)
	end
end

-- end_analyze runs once the response is over whatever happened: whole (released already),
-- cut, not 2xx, or never come (a worker that could not be reached, a client that left).
function Release:end_analyze(txn, chn)
	if chn:is_resp() then
		self:release_once(txn, false)
	end
end

core.register_filter("kvrouter_release", Release, function(flt, args)
	return flt
end)

core.register_init(function()
	local be = core.backends[REPLICAS]
	if not be or next(be.servers) == nil then
		core.Alert("kvrouter.lua: backend " .. REPLICAS .. " with the replicas' client addresses is missing or empty")
	end
end)
