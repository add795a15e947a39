/* bits.reciprocals + bits.quotient against fp32 division: 2.8e8 random (x, s), s from 2**-149 to 2**120,
 * |x| <= LIMIT * s (448 fp8, 127 int8, 15 int4), the scale shift included (stops 27, 28; ~4 s a bound).
 *   gcc -O2 -ffp-contract=off -mfma -o /tmp/quotient_random scripts/quotient_random.c -lm
 *   /tmp/quotient_random 448 && /tmp/quotient_random 127 && /tmp/quotient_random 15 */
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <stdlib.h>
static float f_of(uint32_t u){float f; memcpy(&f,&u,4); return f;}
static uint32_t u_of(float f){uint32_t u; memcpy(&u,&f,4); return u;}
static uint64_t st=88172645463325252ull;
static uint32_t rnd(){st^=st<<13;st^=st>>7;st^=st<<17;return (uint32_t)st;}
static float fastk(float x, float s){
  float k = s < 0x1p-90f ? 0x1p100f : (s > 0x1p100f ? 0x1p-100f : 1.0f);
  float sk = s * k, y = 1.0f / sk, xk = x * k;
  /* the residual negated (q0 * sk - xk): q0 - neg * y keeps a zero quotient's sign untested. volatile:
   * gcc -O2 folds -fmaf(a, b, -c) into fmaf(-a, b, c), which is not the same for signed zeros (the
   * GPU's FFMA takes negated operands as they are: see bits.quotient) */
  float q0 = xk * y; volatile float neg = fmaf(q0, sk, -xk);
  return fmaf(-neg, y, q0);
}
int main(int argc, char** argv){
  float lim = argc > 1 ? (float)atof(argv[1]) : 448.0f;
  long bad=0,n=0, small=0;
  for (int e=-149; e<=120; e+=1){
    for (uint32_t j=0;j<(1u<<20);j++){
      float s;
      if (e < -126) { s = f_of(rnd() & ((1u << (e + 149 + 1)) - 1)); if (s == 0) s = f_of(1); }
      else s = f_of(((uint32_t)(127+e)<<23)|(rnd() & 0x7fffff));
      float amax = s*lim;
      if (isinf(amax)) continue;
      uint32_t r = rnd();
      int drop = r % 70;
      int ex = (int)(u_of(amax) >> 23) - drop;
      float x;
      if (ex >= 1) x = f_of(((uint32_t)ex << 23) | (rnd() & 0x7fffff));
      else x = f_of(rnd() & 0x7fffff);
      if (x > amax) x = amax;
      if (r & (1u<<31)) x = -x;
      float q = fastk(x,s), want = x/s;
      n++;
      if (u_of(q)==u_of(want)) continue;
      if ((u_of(q)>>31)!=(u_of(want)>>31) || fabsf(want) >= 0x1p-12f || fabsf(q) >= 0x1p-12f) {
        if (bad < 10) printf("s=%a x=%a q=%a want=%a\n", s, x, q, want); bad++; } else small++;
    }
  }
  printf("checked %ld, bad %ld, differing below 2^-12 only: %ld\n", n, bad, small);
}
