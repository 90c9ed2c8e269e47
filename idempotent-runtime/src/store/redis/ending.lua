-- idempotent: completion and release, the writes of every executed call, as one short
-- script without record.lua's helper functions (a script's body runs on every call, so
-- every helper it defines is built again each time).
--
-- KEYS[1]  the record's key
-- Either three arguments, the completion of a claim as the fast claim wrote it:
--   ARGV[1]  ttl ms
--   ARGV[2]  the in-progress record the owner's claim wrote, byte for byte
--   ARGV[3]  the completed record to write in its place: 'C', then the claimed record's
--            token, fingerprint and fence (its head after 'P', up to the fence's ':'),
--            '0:', the result
-- or:
--   ARGV[1]  the operation: complete | release | reopen (an operator's: any state)
--   ARGV[2]  the owner's token
--   complete: ARGV[3] ttl ms, ARGV[4] result ('' for none), and, when the owner knows its
--             claim's fence, ARGV[5] the head of the in-progress record it holds:
--             'P' .. token .. ('F' .. fingerprint or '-') .. fence .. ':'
--   release:  when the owner's claim may be a fast claim, ARGV[3] the in-progress record it
--             wrote, byte for byte, and ARGV[4] the released record to write in its place
--             ('R', the token, '-', the fence, ':0:')
--
-- The record is read exactly as record.lua reads it (same format, same checks): a value that
-- is not such a record, or a key of another type, answers IDEMPOTENT_CORRUPT and is left as
-- it is. The fence is carried over as written. Three exceptions, each on a value that holds
-- the owner's own 16-byte token, which only its claim wrote: the value its claim wrote,
-- unchanged, is replaced by the completed record, or the released one, the owner sent; a
-- value that starts with the head the owner sent is completed without reading the fields
-- after the fence (the lease end and the claim's time, which a completion discards).

local v = redis.pcall('GET', KEYS[1])
local op, token, ttl, result, head, completed
if #ARGV == 3 then
  -- The common completion: the key holds the owner's claim as it was written (not renewed
  -- since). A compare and set, as a hand-written completion is.
  if v == ARGV[2] then
    redis.call('SET', KEYS[1], ARGV[3], 'PX', ARGV[1])
    return 1
  end
  -- Otherwise a completion as any other, its parts read from the two records: the token
  -- after the state, the head up to the ':' after the fence (the fields after the token and
  -- the fingerprint are digits), the result after the head's fields and '0:'.
  local claimed = ARGV[2]
  local fence_end = string.find(claimed, ':', string.sub(claimed, 18, 18) == 'F' and 35 or 19,
    true)
  if string.sub(claimed, 1, 1) ~= 'P' or not fence_end then
    return redis.error_reply('idempotent: malformed completion')
  end
  op, token, ttl = 'complete', string.sub(claimed, 2, 17), ARGV[1]
  head, completed = string.sub(claimed, 1, fence_end), ARGV[3]
  result = string.sub(completed, fence_end + 3)
elseif ARGV[1] == 'release' then
  -- The common release: the key holds the owner's claim as it was written (not renewed
  -- since). A compare and set, as a hand-written unlock is.
  if ARGV[3] and v == ARGV[3] then
    redis.call('SET', KEYS[1], ARGV[4], 'KEEPTTL')
    return 1
  end
  op, token = 'release', ARGV[2]
else
  op, token, ttl, result, head = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
end
-- The key still holds the owner's claim, with the head the owner knows (state, its token,
-- fingerprint and fence, which a record's first fields are, the fence ended by its ':'). The
-- completed record is that head's fields, no lease, the result: what the general path below
-- writes for it, with no parsing.
if head and type(v) == 'string' and string.find(v, head, 1, true) == 1 then
  redis.call('SET', KEYS[1], completed or ('C' .. string.sub(head, 2) .. '0:' .. result),
    'PX', ttl)
  return 1
end
if type(v) == 'table' then
  return redis.error_reply('IDEMPOTENT_CORRUPT value of another type: ' .. tostring(v.err))
end
if not v then return 0 end
local state = string.sub(v, 1, 1)
if state ~= 'P' and state ~= 'C' and state ~= 'R' then
  return redis.error_reply('IDEMPOTENT_CORRUPT unknown state')
end
local marker, pos = string.sub(v, 18, 18), 19
if marker == 'F' then
  pos = 35
elseif marker ~= '-' then
  return redis.error_reply('IDEMPOTENT_CORRUPT no fingerprint marker')
end
local fence, lease_end = string.match(v, '^(%d+):(%d+):', pos)
if not fence then
  return redis.error_reply('IDEMPOTENT_CORRUPT malformed fence or lease')
end
if tonumber(fence) > 9007199254740990 or tonumber(lease_end) > 9007199254740990 then
  return redis.error_reply('IDEMPOTENT_CORRUPT number out of range')
end
if string.sub(v, 2, 17) ~= token then return 0 end

if op == 'complete' then
  if state == 'C' then return 1 end
  if state ~= 'P' then return 0 end
  -- State, token and fingerprint as they were, the fence, no lease, the result.
  redis.call('SET', KEYS[1], 'C' .. string.sub(v, 2, pos - 1) .. fence .. ':0:' .. result,
    'PX', ttl)
  return 1
elseif op == 'release' then
  if state ~= 'P' then return 0 end
  redis.call('SET', KEYS[1], 'R' .. token .. '-' .. fence .. ':0:', 'KEEPTTL')
  return 1
elseif op == 'reopen' then
  redis.call('SET', KEYS[1], 'R' .. token .. '-' .. fence .. ':0:', 'KEEPTTL')
  return 1
end

return redis.error_reply('idempotent: unknown operation ' .. tostring(op))
