/* bits.quotient against fp32 division: every fp32 x in [-448 s, 448 s] for 7 scales s (the exhaustive
 * check of stops 27 and 28; ~35 s). Prints, per scale, how many x a plain multiply by the reciprocal gets wrong
 * and how many the corrected quotient gets wrong where a code could see it (>= 2**-12, or the sign).
 *   gcc -O2 -ffp-contract=off -mfma -o /tmp/quotient_exhaustive scripts/quotient_exhaustive.c -lm && /tmp/quotient_exhaustive */
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
static float f_of(uint32_t u){float f; memcpy(&f,&u,4); return f;}
static uint32_t u_of(float f){uint32_t u; memcpy(&u,&f,4); return u;}
static float fast(float x, float s, float y){
  /* the residual negated (q0 * s - x): q0 - neg * y keeps a zero quotient's sign untested. volatile:
   * gcc -O2 folds -fmaf(a, b, -c) into fmaf(-a, b, c), which is not the same for signed zeros (the
   * GPU's FFMA takes negated operands as they are: see bits.quotient) */
  float q0 = x * y; volatile float neg = fmaf(q0, s, -x);
  return fmaf(-neg, y, q0);
}
int main(){
  uint32_t ss[] = {0x3f800000u, 0x3fffffffu, 0x3f800001u, 0x3fc00000u|0x12345u, 0x1ffffffu|0x20000000u, 0x5effffffu, 0x3b12f4e3u};
  for (int i=0;i<7;i++){
    float s = f_of(ss[i]); float y = 1.0f/s; float amax = s*448.0f;
    long bad=0, mul=0, n=0;
    for (uint32_t u=0; u<=u_of(amax); u++){
      float x = f_of(u);
      for (int sg=0; sg<2; sg++){
        float xx = sg ? -x : x;
        float q = fast(xx,s,y), want = xx/s;
        n++;
        if (u_of(xx*y) != u_of(want)) mul++;
        if (u_of(q)!=u_of(want) && (fabsf(want) >= 0x1p-12f || (u_of(q)>>31)!=(u_of(want)>>31))) bad++;
      }
    }
    printf("s=%a: %ld x, x*y wrong %ld, fast wrong %ld\n", s, n, mul, bad);
  }
}
